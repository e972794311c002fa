"""Edits of a gateway keys file that keep what an operator wrote: comments, order, every other entry.

Used by `switchboard keys` (data_plane/gateway/keys_cli.py); the gateway reads the file
(data_plane/gateway/auth.py KeyStore.from_yaml) and reloads it within a second of a change
(data_plane/gateway/keys_file.py).

    with locked(path):                               # fcntl.flock on a lock file beside it
        text, entries = read_keys_file(path)         # entries: the `keys` list, validated
        write_atomic(path, append_entry(text, {"key_sha256": d, "tenant": "acme", "tier": "plus"}))
        write_atomic(path, remove_entries(text, {0, 3}))
        write_atomic(path, set_fields(text, {2: {"tier": "enterprise"}}))

Why text edits: PyYAML cannot write comments back, and a keys file carries them (who a key is for,
when it was issued). An edit is made on the text, guided by the node positions PyYAML's composer
reports; the result is parsed again and must equal the intended data, else (a layout this editor does
not follow: flow style around the list, anchors, odd indentation) the file is written afresh from the
data, with its leading comment block kept. Either way every other entry keeps all its fields.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from data_plane.common.yaml_source import parse_yaml
from data_plane.gateway.auth import KeyStore

NEW_FILE_HEADER = "# Gateway API keys (switchboard keys create / list / revoke). Only digests of new keys are stored.\n"


class _Unsupported(Exception):
    """A layout the text editor does not follow: the caller writes the file from the data instead."""


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for one read-modify-write of `path`. The lock file is never deleted: removing
    it while another process waits on it would let a third lock a new file and both write at once."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def read_keys_file(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The file's text and its entries, after the gateway's own validation (ValueError naming the file,
    never echoing a key). A missing file is FileNotFoundError."""
    text = path.read_text()
    data = parse_yaml(text, str(path))
    KeyStore.from_dict(data, where=str(path))
    entries = (data or {}).get("keys") or []
    return text, [dict(e) for e in entries]


def write_atomic(path: Path, text: str, *, exclusive: bool = False) -> bool:
    """Write `text` to a temporary file beside `path` (mode 600), fsync it, rename it over `path`: a
    reader (a gateway's reload) sees the old file or the new one, never half of one. `exclusive`: only
    if `path` does not exist yet (a hard link, not a rename: concurrent creators agree on one file);
    False when another process made it first."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the rename itself durable (not possible on every filesystem)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return True


def _load_entries(text: str) -> list[Any]:
    data = yaml.safe_load(text) if text.strip() else None
    return list((data or {}).get("keys") or []) if isinstance(data, dict) or data is None else []


def _header(text: str) -> str:
    """The file's leading comment block (kept when the file is written afresh)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line.lstrip().startswith("#"):
            break
        out.append(line)
    return "".join(out).rstrip("\n") + "\n" if any(line.strip() for line in out) else ""


def _dump(entries: list[Any], header: str) -> str:
    return header + yaml.safe_dump({"keys": entries}, sort_keys=False, default_flow_style=False, width=1000)


def _render(entry: dict[str, Any], indent: int, flow: bool) -> str:
    """`entry` as one block-sequence item at column `indent` (a one-line flow mapping if its siblings are)."""
    body = yaml.safe_dump([entry], sort_keys=False, default_flow_style=None if flow else False, width=1000)
    return "".join(" " * indent + line for line in body.splitlines(keepends=True))


def _compose(text: str) -> tuple[yaml.MappingNode | None, yaml.Node | None]:
    """The root mapping and its ``keys`` value node (either None where absent)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader) if text.strip() else None
    if root is None:
        return None, None
    if not isinstance(root, yaml.MappingNode) or root.flow_style:
        raise _Unsupported
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "keys":
            return root, value
    return root, None


def _last_line(node: yaml.Node) -> int:
    """The last line holding `node`'s content: its scalars' ends (a block collection's own end mark lies
    at the next token, possibly lines further down, past comments)."""
    if isinstance(node, yaml.ScalarNode):
        end = node.end_mark
        return end.line if end.column > 0 else end.line - 1
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    if not children or node.flow_style:
        end = node.end_mark
        return end.line if end.column > 0 else end.line - 1
    return max(_last_line(c) for c in children)


def _item_lines(text: str, item: yaml.Node) -> tuple[int, int, int]:
    """(first line, last line, column of its '-') of one block-sequence item, which must start its line
    (only indentation before its '-'). What follows its content on its last line can only be a comment."""
    i = item.start_mark.index - 1
    while i >= 0 and text[i] in " \t":
        i -= 1
    if i < 0 or text[i] != "-":
        raise _Unsupported
    line_start = text.rfind("\n", 0, i) + 1
    if text[line_start:i].strip():
        raise _Unsupported
    return item.start_mark.line, _last_line(item), i - line_start


def _edited_append(text: str, entry: dict[str, Any]) -> str:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    root, seq = _compose(text)
    if seq is None or (isinstance(seq, yaml.ScalarNode) and seq.value in ("", "~", "null")):
        if seq is not None:
            raise _Unsupported  # `keys:` with nothing: not a valid keys file in the first place
        indent = 0 if root is None else root.start_mark.column
        return "".join(lines) + " " * indent + "keys:\n" + _render(entry, indent, flow=False)
    if not isinstance(seq, yaml.SequenceNode) or seq.flow_style or not seq.value:
        raise _Unsupported
    *_, (_, last, column) = (_item_lines(text, item) for item in seq.value)
    flow = bool(getattr(seq.value[-1], "flow_style", False))
    return "".join(lines[: last + 1]) + _render(entry, column, flow) + "".join(lines[last + 1:])


def _edited_remove(text: str, indexes: set[int]) -> str:
    lines = text.splitlines(keepends=True)
    _, seq = _compose(text)
    if not isinstance(seq, yaml.SequenceNode) or seq.flow_style:
        raise _Unsupported
    if len(indexes) >= len(seq.value):
        raise _Unsupported  # the list would be left empty (`keys:` alone is null): written afresh as []
    drop: set[int] = set()
    for i in indexes:
        first, last, _ = _item_lines(text, seq.value[i])
        drop.update(range(first, last + 1))
    return "".join(line for n, line in enumerate(lines) if n not in drop)


def _edited_fields(text: str, changes: dict[int, dict[str, str]]) -> str:
    """`text` with plain-scalar fields of some entries given new values, in place (comments kept)."""
    _, seq = _compose(text)
    if not isinstance(seq, yaml.SequenceNode) or seq.flow_style:
        raise _Unsupported
    spans: list[tuple[int, int, str]] = []
    for i, fields in changes.items():
        item = seq.value[i]
        if not isinstance(item, yaml.MappingNode):
            raise _Unsupported
        found = {k.value: v for k, v in item.value if isinstance(k, yaml.ScalarNode)}
        for name, value in fields.items():
            node = found.get(name)
            if not isinstance(node, yaml.ScalarNode) or node.style is not None:
                raise _Unsupported  # absent, or quoted/block: the file is written from the data
            spans.append((node.start_mark.index, node.end_mark.index, value))
    for start, end, value in sorted(spans, reverse=True):
        text = text[:start] + value + text[end:]
    return text


def _checked(edit: Any, text: str, expected: list[Any]) -> str:
    """`edit()`'s text if it parses to exactly `expected` entries; else the file written from the data."""
    try:
        new = str(edit())
        if _load_entries(new) == expected and isinstance(yaml.safe_load(new), dict):
            return new
    except (_Unsupported, yaml.YAMLError, IndexError):
        pass
    return _dump(expected, _header(text) if text.strip() else NEW_FILE_HEADER)


def append_entry(text: str, entry: dict[str, Any]) -> str:
    """`text` (a keys file, possibly empty) with `entry` added after the last entry."""
    expected = [*_load_entries(text), entry]
    return _checked(lambda: _edited_append(text if text.strip() else NEW_FILE_HEADER, entry), text, expected)


def remove_entries(text: str, indexes: set[int]) -> str:
    """`text` without the entries at `indexes` (positions in its `keys` list)."""
    expected = [e for i, e in enumerate(_load_entries(text)) if i not in indexes]
    return _checked(lambda: _edited_remove(text, indexes), text, expected)


def set_fields(text: str, changes: dict[int, dict[str, str]]) -> str:
    """`text` with the entries at the given positions changed (``{3: {"tier": "plus"}}``), every other field
    and entry as it was."""
    expected = [{**e, **changes[i]} if i in changes else e for i, e in enumerate(_load_entries(text))]
    return _checked(lambda: _edited_fields(text, changes), text, expected)


__all__ = ["append_entry", "lock_path", "locked", "read_keys_file", "remove_entries", "set_fields",
           "write_atomic"]
