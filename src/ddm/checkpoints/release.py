"""What a directory someone else made (a release ``ddm import`` reads) may hold, checked
before anything in it is loaded or copied.

``ddm import`` has libraries load parts of a release and copies its files into a DDM that
fetchers then ship, so every entry under the release is judged by ``lstat`` (no link followed):

- only regular files and directories: a symbolic link (``tokenizer/vocab.json`` ->
  ``/proc/self/environ`` would be copied into the DDM), a device, a FIFO or a socket is refused
  by its path; a regular file's other hard links must all be inside the release too;
- every JSON file parses (an error names it, where a library would say only "Expecting
  value") and none declares ``auto_map``: transformers and diffusers would import the
  release's own Python for it, and ddm runs no code from a release;
- every safetensors file's header parses.

Files are then opened without following links (``ddm.fileio.open_regular``), so an entry
replaced by a link after this check is refused too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ddm.checkpoints.declared import load_config_json
from ddm.checkpoints.format import CheckpointError, safetensors_header

#: A release's entries (files and directories); Paris's has about 30.
MAX_RELEASE_ENTRIES = 4096
#: Its largest JSON file: a tokenizer.json (CLIP's is 2 MB).
MAX_RELEASE_JSON_BYTES = 64 << 20
#: The config key with which transformers and diffusers load a repository's own classes.
REMOTE_CODE_KEY = "auto_map"
_LINK_HINT = ("; a Hugging Face cache snapshot links to its blobs: download the release with "
              "--local-dir, or copy it with cp -rL, and import the copy")


def check_release(root: Path) -> None:
    """Refuse ``root`` unless it holds only regular files and directories (``MAX_RELEASE_
    ENTRIES`` at most), each JSON file parses and asks for no code, each safetensors header
    parses; a ``CheckpointError`` names the first path that does not."""
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    files: list[Path] = []
    links: dict[tuple[int, int], list[Path]] = {}
    entries, pending = 0, [root]
    while pending:
        with os.scandir(pending.pop()) as scan:
            found = sorted(scan, key=lambda entry: entry.name)
        for entry in found:
            entries += 1
            if entries > MAX_RELEASE_ENTRIES:
                raise CheckpointError(f"{root} holds more than {MAX_RELEASE_ENTRIES} files and "
                                      "directories; is it a release?")
            path, info = Path(entry.path), entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
            elif not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path} is {_kind(info.st_mode)}: a release may hold "
                                      "only regular files and directories"
                                      f"{_LINK_HINT if stat.S_ISLNK(info.st_mode) else ''}")
            else:
                files.append(path)
                if info.st_nlink > 1:
                    links.setdefault((info.st_dev, info.st_ino), []).append(path)
    for paths in links.values():
        if len(paths) < paths[0].stat(follow_symlinks=False).st_nlink:
            raise CheckpointError(f"{paths[0]} is a hard link to a file outside {root}: a "
                                  "release may hold only its own files")
    for path in sorted(files):
        if path.suffix == ".json":
            _check_json(path)
        elif path.suffix == ".safetensors":
            safetensors_header(path)


def _check_json(path: Path) -> None:
    try:
        document = load_config_json(path, MAX_RELEASE_JSON_BYTES)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if isinstance(document, dict) and REMOTE_CODE_KEY in document:
        raise CheckpointError(f"{path} declares {REMOTE_CODE_KEY}: it asks the library to run "
                              "the release's own Python code, which ddm never does; remove "
                              f"{REMOTE_CODE_KEY} if the release's classes are the library's")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
