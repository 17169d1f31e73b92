"""Typed reads from untyped JSON (a resource's spec) that collect problems with field paths.

Used by ``spec``: each problem reads like ``spec.experts[1].replicas: must be an integer in
0..64, got -1``, the form the API server uses for its own schema errors.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping


class FieldReader:
    """Reads the fields of one object, recording each problem with its path; never raises.

    A bad value is recorded and replaced by the default, so reading goes on and every
    problem is found in one pass. ``done()`` records the keys nobody asked for.
    """

    def __init__(self, raw: Any, path: str, problems: list[str]) -> None:
        self.path, self.problems, self.seen = path, problems, set()
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            problems.append(f"{path}: must be an object, got {raw!r}")
            raw = {}
        self.raw: Mapping[str, Any] = raw

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{self.path}.{key}: {message}")

    def has(self, key: str) -> bool:
        return key in self.raw

    def value(self, key: str) -> Any:
        self.seen.add(key)
        return self.raw.get(key)

    def integer(self, key: str, default: int | None, low: int, high: int) -> int | None:
        value = self.value(key)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            self.problem(key, f"must be an integer in {low}..{high}, got {value!r}")
            return default
        return value

    def number(self, key: str, default: float | None, low: float, high: float
               ) -> float | None:
        value = self.value(key)
        if value is None:
            return default
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not low <= value <= high):
            self.problem(key, f"must be a number in {low:g}..{high:g}, got {value!r}")
            return default
        return float(value)

    def string(self, key: str, default: str | None, *, choices: tuple[str, ...] = (),
               pattern: str | None = None, hint: str = "", max_length: int = 1024) -> str | None:
        value = self.value(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value or len(value) > max_length:
            self.problem(key, f"must be a string of 1..{max_length} characters, got {value!r}")
        elif choices and value not in choices:
            self.problem(key, f"must be one of {', '.join(choices)}, got {value!r}")
        elif pattern and not re.match(pattern, value):
            self.problem(key, f"{value!r} is not valid{': ' + hint if hint else ''}")
        else:
            return value
        return default

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.value(key)
        if value is not None and not isinstance(value, Mapping):
            self.problem(key, f"must be an object, got {value!r}")
            return None
        return value

    def items(self, key: str) -> list[Any]:
        value = self.value(key)
        if value is None:
            return []
        if not isinstance(value, list):
            self.problem(key, f"must be a list, got {value!r}")
            return []
        return value

    def child(self, key: str) -> FieldReader:
        return FieldReader(self.value(key), f"{self.path}.{key}", self.problems)

    def done(self) -> None:
        """Record the keys nobody asked for, each with the field it most resembles."""
        unknown = sorted((key for key in self.raw if key not in self.seen), key=str)
        if unknown:
            fields = sorted(self.seen - set(self.raw))
            guesses = [f"{match[0]!r} for {key!r}" for key in unknown
                       if (match := difflib.get_close_matches(str(key), fields, n=1))]
            self.problems.append(f"{self.path}: unknown fields {unknown}" +
                                 (f" (did you mean {', '.join(guesses)}?)" if guesses else ""))
