"""Extract a fetched checkpoint archive (a ``.tar.gz`` or ``.tar``), which a tenant or a store
may have crafted, into a new directory.

``tarfile`` does work of its own while it parses a member's headers, before any check of ours
sees the member: it reads a pax header or a GNU long name whole, and a GNU sparse file's map
(``GNU.sparse.*`` pax records, or an old ``S`` member's extension blocks) into lists, one
entry per number. A 47 KB ``.tar.gz`` whose sparse map held 12 million entries took the
fetcher to 2.3 GB and 39 s of CPU before it failed. So, before ``tarfile`` processes a header:

- its type must be one we extract (regular files and directories) or the extended header of
  one (a pax header, a GNU long name): links, devices, FIFOs, sparse and unknown members are
  refused by name;
- an extended header may hold at most :data:`MAX_ARCHIVE_HEADER_BYTES`, and a pax header
  no ``GNU.sparse.*`` record;
- every decompressed byte ``tarfile`` reads, headers included, counts against the byte limit
  left for the checkpoint.

Then each member is written strictly inside the directory, at most ``max_entries`` of them.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import re
import shutil
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator

from ddm.checkpoints.download import FetchError

#: The most an archive's extended header (a pax header, a GNU long name) may hold: tarfile
#: reads one whole, so its claimed size is memory; a checkpoint's need a few names.
MAX_ARCHIVE_HEADER_BYTES = 1 << 20
#: The member types extracted, and the extended headers that describe them (a pax header for
#: one member or all, a GNU long name): what ``tarfile``, GNU tar and ``git archive`` write
#: for a directory of files.
_EXTRACTED = frozenset({tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE})
_PAX_HEADERS = frozenset({tarfile.XHDTYPE, tarfile.XGLTYPE})
_EXTENDED_HEADERS = _PAX_HEADERS | {tarfile.GNUTYPE_LONGNAME}
#: A pax record of GNU's sparse files: tarfile reads the sparse map it announces whole.
_SPARSE_KEY = re.compile(rb"GNU\.sparse\.[^=\n]{0,64}")
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


def extract_archive(archive: Path, root: Path, limit: int, max_entries: int) -> None:
    """Extract ``archive`` (gzip-compressed or plain) into the new directory ``root``: regular
    files and directories only, each strictly inside ``root``, at most ``max_entries``, in
    all at most ``limit`` decompressed bytes. Raises ``FetchError`` naming what is refused."""
    root.mkdir()
    try:
        with _open(archive, limit) as tar:
            for count, member in enumerate(tar, 1):
                if count > max_entries:
                    raise FetchError(f"the archive holds more than {max_entries} entries")
                relative = _member_path(member)
                path = root.joinpath(*relative.parts)
                try:
                    if member.isdir():
                        path.mkdir(parents=True, exist_ok=True)
                        continue
                    path.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    assert source is not None, member.name  # a regular file always has data
                    with source, open(path, "xb") as out:
                        shutil.copyfileobj(source, out, _CHUNK)
                except (FileExistsError, NotADirectoryError):
                    raise FetchError(_clash(root, relative, member.isdir())) from None
                except FetchError as exc:
                    raise FetchError(f"archive member {member.name}: {exc}") from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise FetchError(f"not a readable tar archive ({exc})") from None


@contextlib.contextmanager
def _open(archive: Path, limit: int) -> Iterator[tarfile.TarFile]:
    """``archive`` as a ``TarFile`` reading through :class:`_Inflated` with
    :class:`_CheckedHeader`s: decompressed here (gzip, by its magic), so that every byte
    ``tarfile`` reads passes through the count."""
    with contextlib.ExitStack() as stack:
        stream: BinaryIO = stack.enter_context(open(archive, "rb"))
        if stream.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC:
            stream.seek(0)
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))
        else:
            stream.seek(0)
        yield stack.enter_context(tarfile.TarFile(
            fileobj=_Inflated(stream, limit), mode="r",  # type: ignore[arg-type]
            tarinfo=_CheckedHeader))


class _Inflated:
    """The archive's decompressed bytes as ``tarfile`` reads them, each counted against
    ``limit`` (headers too: tarfile reads them before any member is ours to check), with a
    :meth:`peek` that lets a header be judged before tarfile parses it. ``tarfile`` reads an
    archive in order: it seeks forward only (past padding)."""

    def __init__(self, stream: BinaryIO, limit: int) -> None:
        self._stream, self._limit = stream, limit
        self._ahead = b""  # peeked, not yet read
        self._position = 0  # bytes read
        self._inflated = 0  # bytes taken from the stream: read or peeked

    def read(self, size: int = -1) -> bytes:
        assert size >= 0, "tarfile reads blocks and members of known sizes"
        data, self._ahead = self._ahead[:size], self._ahead[size:]
        if len(data) < size:
            data += self._take(size - len(data))
        self._position += len(data)
        return data

    def peek(self, size: int) -> bytes:
        """The next ``size`` bytes (fewer at the end), which the next reads return again."""
        if len(self._ahead) < size:
            self._ahead += self._take(size - len(self._ahead))
        return self._ahead[:size]

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        assert whence == io.SEEK_SET and offset >= self._position, "tarfile reads forward"
        while self._position < offset and self.read(min(offset - self._position, _CHUNK)):
            pass
        return self._position

    def _take(self, size: int) -> bytes:
        data = self._stream.read(size)
        self._inflated += len(data)
        if self._inflated > self._limit:
            raise FetchError(f"the archive inflates to more than the {self._limit}-byte limit "
                             "left for this checkpoint")
        return data


class _CheckedHeader(tarfile.TarInfo):
    """A member's header, refused before ``tarfile`` processes it when its type is not one we
    extract (or an extended header of one), when an extended header claims more than
    :data:`MAX_ARCHIVE_HEADER_BYTES` (in 512 bytes, it may claim up to 2**88), or when a pax
    header holds a GNU sparse record."""

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:
        header = super().frombuf(buf, encoding, errors)
        if header.type not in _EXTRACTED | _EXTENDED_HEADERS:
            raise FetchError(f"archive member {header.name!r} is a {_kind(header.type)}; only "
                             "regular files and directories are extracted")
        if header.type in _EXTENDED_HEADERS and header.size > MAX_ARCHIVE_HEADER_BYTES:
            raise FetchError(f"the archive has an extended header of {header.size} bytes; at "
                             f"most {MAX_ARCHIVE_HEADER_BYTES} are read")
        return header

    def _proc_member(self, archive: Any) -> tarfile.TarInfo:
        # tarfile's own hook for a member's processing (see TarInfo._proc_member): a pax
        # header's records are peeked at here, before _proc_pax reads and applies them.
        if self.type in _PAX_HEADERS:
            blocks = -(-self.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            sparse = _SPARSE_KEY.search(archive.fileobj.peek(blocks))
            if sparse:
                raise FetchError(f"the archive has a GNU sparse file (pax record "
                                 f"{sparse.group().decode('ascii', 'replace')}); only regular "
                                 "files and directories are extracted")
        return super()._proc_member(archive)


def _kind(member_type: bytes) -> str:
    if member_type in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.GNUTYPE_LONGLINK):
        return "link"
    if member_type == tarfile.GNUTYPE_SPARSE:
        return "GNU sparse file"
    return "special file"


def _member_path(member: tarfile.TarInfo) -> PurePosixPath:
    """The member's relative path, or a ``FetchError`` if it escapes the directory."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise FetchError(f"archive member {member.name!r} would be written outside the "
                         "checkpoint directory")
    return path


def _clash(root: Path, relative: PurePosixPath, is_dir: bool) -> str:
    """Why the member at ``relative`` (a directory if ``is_dir``) could not be written under
    ``root``: a path the archive holds as a file and also needs as a directory (``a``, then
    ``a/b``; or the other way round), or one file twice."""
    for depth in range(1, len(relative.parts)):
        above = "/".join(relative.parts[:depth])
        if root.joinpath(above).is_file():
            return f"the archive holds {above!r} both as a file and as a directory"
    if not is_dir and root.joinpath(relative).is_file():
        return f"the archive holds the file {str(relative)!r} twice"
    return f"the archive holds {str(relative)!r} both as a file and as a directory"
