"""`switchboard keys`: issue, list, re-tier and revoke the gateway's API keys without editing YAML by hand.

    switchboard keys create --tenant acme --tier plus --name ci-bot   # prints the new key once
    switchboard keys list                                             # KEY ID, TENANT, TIER, NAME
    switchboard keys list --json
    switchboard keys revoke --digest 3f0a1b2c                         # a key id (digest prefix) from `list`
    switchboard keys revoke --tenant acme                             # every key of a tenant
    printf %s "$KEY" | switchboard keys revoke --key -                # the key itself, kept out of `ps`
    switchboard keys set-tier --digest 3f0a1b2c --tier enterprise     # the same key, another tier's limits

Why: operators edited the keys file by hand and computed each key's SHA-256 themselves, so keys went
into the file in plaintext and a typo surfaced only as a gateway log line. `create` stores only the
new key's digest (nothing secret at rest) and prints the key once; `list` never prints a key, even one
the file holds in plaintext (its digest prefix instead: the key id the gateway logs and the usage ledger
record). Every change is written atomically under a lock (data_plane/gateway/keys_edit.py), checked
with the gateway's own validation first, and running gateways put it in force within about a second
(data_plane/gateway/keys_file.py).

The file: ``--keys-file``, else ``SWITCHBOARD_GATEWAY_KEYS_FILE`` (the gateway's own variable), else
``keys.yaml`` in ``switchboard up``'s state dir (``SWITCHBOARD_UP_STATE_DIR``, default ``.switchboard``):
run from the directory `switchboard up` runs in, a new key works on its gateway with no flag.

Exit codes: 0 done; 1 nothing matched, or the keys file is missing, unreadable or invalid; 2 a usage
error: a bad flag, an unknown tier, a digest prefix matching several keys.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from data_plane.common.yaml_source import load_yaml
from data_plane.gateway.auth import KEY_ID_LENGTH, LABEL_PATTERN, NAME_PATTERN, generate_key, key_digest
from data_plane.gateway.keys_edit import (
    append_entry,
    locked,
    read_keys_file,
    remove_entries,
    set_fields,
    write_atomic,
)
from data_plane.tiers import TierPolicy

PROG = "switchboard keys"
UP_STATE_DIR = ".switchboard"
"""`switchboard up`'s default --state-dir (control_plane/launcher.py UpSettings; a test holds them equal)."""
KEYS_FILE_ENV = "SWITCHBOARD_GATEWAY_KEYS_FILE"
UP_TIERS_FILE = Path("control-plane") / "tiers.json"
"""Where `switchboard up`'s control plane keeps the tier policy an operator edits (the console, PUT
/admin/v1/tiers), relative to up's state dir: the launcher's `--state-dir STATE/control-plane` and
control_plane/policy_store.py's TIERS_FILE (a test holds them equal). What `create` checks --tier against
for a keys file in that state dir: the gateways `up` runs follow that policy, not the built-in one."""
MIN_PREFIX = 6
"""Shortest digest prefix `revoke --digest` takes: a shorter one matches the wrong key too easily."""
_HEX = re.compile(r"^[0-9a-f]+$")


def up_state_dir() -> Path:
    """`switchboard up`'s state dir as its clients find it (`switchboard keys`, `switchboard admin`, the
    console): $SWITCHBOARD_UP_STATE_DIR, as `up --state-dir` was given, else .switchboard/ here."""
    return Path(os.environ.get("SWITCHBOARD_UP_STATE_DIR") or UP_STATE_DIR)


def default_keys_file() -> Path:
    """The file `switchboard keys` edits when --keys-file is not given (see the module's docstring)."""
    if os.environ.get(KEYS_FILE_ENV):
        return Path(os.environ[KEYS_FILE_ENV])
    return up_state_dir() / "keys.yaml"


def _fail(code: int, message: str) -> NoReturn:
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(code)


def _name(what: str, pattern: str, rule: str) -> Any:
    def check(text: str) -> str:
        if not re.match(pattern, text):
            raise argparse.ArgumentTypeError(f"{what} {text!r}: {rule}")
        return text
    return check


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keys-file", type=Path, default=None, help=(
        f"the gateway's keys file to edit (env {KEYS_FILE_ENV}; default: keys.yaml in `switchboard up`'s "
        f"state dir, $SWITCHBOARD_UP_STATE_DIR or {UP_STATE_DIR}/, relative to the working directory; "
        f"from here: {default_keys_file()})"))
    parser = argparse.ArgumentParser(prog=PROG, description=(
        "Create, list and revoke the gateway's API keys in its keys file. Gateways reload the file within "
        "about a second: a created key works and a revoked one is refused (401) without a restart."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("create", parents=[common], help="make a key; store only its SHA-256; print it once",
                       description="Make a new key, add its SHA-256 (never the key) to the keys file, and print "
                                   "the key once on stdout: it cannot be shown again.")
    name_rule = "letters, digits, _ . @ - (up to 128), starting with a letter or digit"
    p.add_argument("--tenant", required=True, type=_name("tenant", NAME_PATTERN, name_rule), help="the key's tenant")
    p.add_argument("--tier", required=True, type=_name("tier", NAME_PATTERN, name_rule),
                   help="the key's tier; must be in the tier policy")
    p.add_argument("--name", default=None, type=_name("name", LABEL_PATTERN, "one printable line of up to 128"),
                   help="a label for operators (who or what the key is for); the gateway ignores it")
    p.add_argument("--tiers-file", default=None, help=(
        "the gateways' tier policy, a file or inline YAML, to check --tier against (env "
        "SWITCHBOARD_GATEWAY_TIERS_FILE; default: the policy `switchboard up`'s control plane keeps beside the "
        "keys file, as edited in the console, else the built-in free/plus/enterprise)"))
    p = sub.add_parser("list", parents=[common], help="the keys in the file (never a key itself)",
                       description="Every entry of the keys file: its key id (the first hex digits of the key's "
                                   "SHA-256, as gateway logs and the usage ledger show it), tenant, tier and name. "
                                   "STORED says whether the file holds the key in plaintext or only its digest.")
    p.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    p = sub.add_parser("revoke", parents=[common], help="remove keys from the file (gateways refuse them at once)",
                       description="Remove the matching entries from the keys file; running gateways refuse the "
                                   "keys (401) within about a second.")
    _which(p, name_rule)
    p = sub.add_parser("set-tier", parents=[common], help="move keys to another tier (gateways apply it at once)",
                       description="Change the tier of the matching entries in the keys file, in place (the key "
                                   "stays the same); running gateways apply the new tier's limits within about a "
                                   "second. The usage ledger records each request under the tier it was served in.")
    _which(p, name_rule)
    p.add_argument("--tier", required=True, dest="new_tier", type=_name("tier", NAME_PATTERN, name_rule),
                   help="the new tier; must be in the tier policy")
    p.add_argument("--tiers-file", default=None, help="the tier policy to check --tier against (as for create)")
    return parser


def _which(p: argparse.ArgumentParser, name_rule: str) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--digest", help=f"a key id from `{PROG} list` (a SHA-256 hex prefix, {MIN_PREFIX}+ digits)")
    which.add_argument("--key", help="the key itself ('-': read it from stdin, to keep it out of ps and history)")
    which.add_argument("--tenant", type=_name("tenant", NAME_PATTERN, name_rule), help="every key of this tenant")


def _read(path: Path) -> tuple[str, list[dict[str, Any]]]:
    try:
        return read_keys_file(path)
    except FileNotFoundError:
        _fail(1, f"no keys file at {path} (run `switchboard up` there first, or pass --keys-file)")
    except (OSError, ValueError) as exc:
        _fail(1, str(exc))


def _digest(entry: dict[str, Any]) -> str:
    sha = entry.get("key_sha256")
    return str(sha).lower() if sha is not None else key_digest(str(entry.get("key", "")))


def _policy(source: str | Path) -> TierPolicy:
    """A tier policy file (or inline YAML); the control plane's own state file too, whose bookkeeping
    beside ``tiers`` (``updated_at``, ``version``, ...) is not part of the policy."""
    data = load_yaml(source)
    if isinstance(data, dict) and "tiers" in data:
        data = {"tiers": data["tiers"]}
    return TierPolicy.from_dict(data)


def _tiers(source: str | None, keys_file: Path) -> tuple[list[str], str]:
    source = source or os.environ.get("SWITCHBOARD_GATEWAY_TIERS_FILE") or None
    label, where = "--tiers-file", f"tier policy {source}"
    if source is None:
        live = keys_file.parent / UP_TIERS_FILE
        if not live.is_file():
            return TierPolicy.default().names(), "the built-in policy; pass --tiers-file if the gateways use another"
        source = label = str(live)
        where = f"the tier policy of `switchboard up`'s control plane, {live}"
    try:
        return _policy(source).names(), where
    except (OSError, ValueError) as exc:
        _fail(2, f"{label}: {exc}")


def create(args: argparse.Namespace, path: Path) -> None:
    names, where = _tiers(args.tiers_file, path)
    if args.tier not in names:
        _fail(2, f"unknown tier {args.tier!r}; known tiers: {', '.join(sorted(names))} ({where})")
    key = generate_key("sk-sb-")
    entry: dict[str, Any] = {"key_sha256": key_digest(key), "tenant": args.tenant, "tier": args.tier}
    if args.name is not None:
        entry["name"] = args.name
    if not path.exists() and args.keys_file is None:
        _fail(1, f"no keys file at {path} (run `switchboard up` there first, or pass --keys-file)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        text = _read(path)[0] if path.exists() else ""
        _write(path, append_entry(text, entry))
    print(key, flush=True)
    print(f"{PROG}: created key {entry['key_sha256'][:KEY_ID_LENGTH]} (tenant {args.tenant}, tier {args.tier}) "
          f"in {path}; only its digest is stored: the key above cannot be shown again", file=sys.stderr)


def _write(path: Path, text: str) -> None:
    """Write `text` only if the gateway would load it (the same validation as its reload)."""
    from data_plane.common.yaml_source import parse_yaml
    from data_plane.gateway.auth import KeyStore

    try:
        KeyStore.from_dict(parse_yaml(text, str(path)), where=str(path))
    except ValueError as exc:
        _fail(1, f"not written: {exc}")
    write_atomic(path, text)


def rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry, never with its key: the key id, tenant, tier, name and how the key is stored."""
    return [{"key_id": _digest(e)[:KEY_ID_LENGTH], "tenant": e.get("tenant"), "tier": e.get("tier"),
             "name": e.get("name"), "stored": "sha256" if "key_sha256" in e else "plaintext"} for e in entries]


def list_keys(args: argparse.Namespace, path: Path) -> None:
    table = rows(_read(path)[1])
    if args.json:
        print(json.dumps(table, indent=2))
        return
    if not table:
        print(f"no keys in {path}")
        return
    heads = {"key_id": "KEY ID", "tenant": "TENANT", "tier": "TIER", "name": "NAME", "stored": "STORED"}
    widths = {c: max(len(h), *(len(str(r[c] or "-")) for r in table)) for c, h in heads.items()}
    print("  ".join(h.ljust(widths[c]) for c, h in heads.items()).rstrip())
    for r in table:
        print("  ".join(str(r[c] or "-").ljust(widths[c]) for c in heads).rstrip())
    plain = sum(r["stored"] == "plaintext" for r in table)
    if plain:
        print(f"{plain} key(s) stored in plaintext in {path}: revoke and re-create them to keep only digests",
              file=sys.stderr)


def _matches(args: argparse.Namespace, entries: list[dict[str, Any]]) -> set[int]:
    digests = [_digest(e) for e in entries]
    if args.tenant is not None:
        found = {i for i, e in enumerate(entries) if e.get("tenant") == args.tenant}
        return found or _fail(1, f"no keys of tenant {args.tenant!r}")
    if args.key is not None:
        key = sys.stdin.read().strip() if args.key == "-" else args.key
        if not key:
            _fail(2, "--key: empty key")
        found = {i for i, d in enumerate(digests) if d == key_digest(key)}
        return found or _fail(1, "no entry holds that key")
    prefix = args.digest.strip().lower()
    if not _HEX.match(prefix) or not MIN_PREFIX <= len(prefix) <= 64:
        _fail(2, f"--digest: expected {MIN_PREFIX} to 64 hex digits (a key id from `{PROG} list`), got {prefix!r}")
    hits = {d for d in digests if d.startswith(prefix)}
    if not hits:
        _fail(1, f"no key id starts with {prefix}")
    if len(hits) > 1:
        _fail(2, f"{prefix} matches {len(hits)} keys ({', '.join(sorted(h[:KEY_ID_LENGTH] for h in hits))}); "
                 "give more digits")
    return {i for i, d in enumerate(digests) if d in hits}


def _existing(path: Path) -> Path:
    """`path` if the keys file is there: its lock file beside it cannot be made in a missing folder, and
    that error named a hidden lock file instead of the keys file."""
    if not path.exists():
        _fail(1, f"no keys file at {path} (run `switchboard up` there first, or pass --keys-file)")
    return path


def revoke(args: argparse.Namespace, path: Path) -> None:
    with locked(_existing(path)):
        text, entries = _read(path)
        gone = _matches(args, entries)
        _write(path, remove_entries(text, gone))
    for r in (rows(entries)[i] for i in sorted(gone)):
        label = f"  ({r['name']})" if r["name"] else ""
        print(f"revoked {r['key_id']}  tenant {r['tenant']}  tier {r['tier']}{label}")
    print(f"{PROG}: removed {len(gone)} entr{'y' if len(gone) == 1 else 'ies'} from {path}; running gateways "
          "refuse the key(s) within about a second", file=sys.stderr)


def set_tier(args: argparse.Namespace, path: Path) -> None:
    names, where = _tiers(args.tiers_file, path)
    if args.new_tier not in names:
        _fail(2, f"unknown tier {args.new_tier!r}; known tiers: {', '.join(sorted(names))} ({where})")
    with locked(_existing(path)):
        text, entries = _read(path)
        moved = _matches(args, entries)
        _write(path, set_fields(text, {i: {"tier": args.new_tier} for i in moved}))
    for r in (rows(entries)[i] for i in sorted(moved)):
        print(f"{r['key_id']}  tenant {r['tenant']}  tier {r['tier']} -> {args.new_tier}")
    print(f"{PROG}: changed {len(moved)} entr{'y' if len(moved) == 1 else 'ies'} in {path}; running gateways "
          "apply the new tier within about a second", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    path = args.keys_file or default_keys_file()
    try:
        {"create": create, "list": list_keys, "revoke": revoke, "set-tier": set_tier}[args.command](args, path)
    except OSError as exc:  # a read-only folder, a file owned by another user: one line, not a traceback
        _fail(1, f"{exc.filename or path}: {exc.strerror or exc}")


if __name__ == "__main__":
    main()
