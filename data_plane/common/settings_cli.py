"""Flags from a settings class: each field is an env var (via pydantic-settings) and a flag. The one
settings/CLI mechanism of every process (gateway, shard, cache node, control plane, `switchboard up`).

    class ShardSettings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_SHARD_", use_attribute_docstrings=True)
        FLAG_ALIASES: ClassVar[dict[str, str]] = {"--registry": "registry_url"}   # deprecated spellings
        ENV_ONLY: ClassVar[frozenset[str]] = frozenset({"admin_token"})          # secrets: no flag (ps)
        TLS: ClassVar[bool] = False          # no --tls-cert/--tls-key/--ca-bundle in its --help (default: listed)
        port: int = Field(8101, ge=1, le=65535)
        \"\"\"TCP port to listen on.\"\"\"                                    # the flag's help text
        peers: CommaList[AnyHttpUrl] = []                                   # "--peers http://a,http://b"
        tier_rpm: TierMap[int] = {}                                         # "--tier-rpm free=600,plus=6000"

    settings = parse_settings(ShardSettings, argv, prog="switchboard shard")
    # precedence: flag > environment variable > default; validated once, here

    dispatch("switchboard", {"shard": ("data_plane.shard.app", "run one shard")}, argv)   # subcommands

Help text comes from the field (its `description` or attribute docstring), followed by the env
variable(s) and the default, so no help string restates a default by hand. `Literal` fields get
`choices`, booleans `--x/--no-x`. Typed collections (`CommaList`, `TierMap`) arrive as one string in
a flag or an env variable and are split by the model itself, so both paths validate the same way.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, AliasChoices, BeforeValidator, ValidationError
from pydantic_settings import BaseSettings, NoDecode

from data_plane.common.tls import add_tls_flags
from data_plane.common.yaml_source import is_inline

S = TypeVar("S", bound=BaseSettings)
T = TypeVar("T")

REDIS_URL_PATTERN = r"^(redis|rediss|unix)://"
"""What redis-py's from_url takes (a cache node's --redis, `up --redis`): another value was a traceback at start."""


def split_commas(value: object) -> object:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``; anything else unchanged (lists, JSON from code)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def split_pairs(value: object) -> object:
    """``"free=600, plus=6000"`` -> ``{"free": "600", "plus": "6000"}`` (the model types the values);
    an item without ``=`` or a name is a ValueError naming it."""
    if not isinstance(value, str):
        return value
    out: dict[str, str] = {}
    for item in value.split(","):
        if not item.strip():
            continue
        name, sep, raw = item.partition("=")
        if not sep or not name.strip() or not raw.strip():
            raise ValueError(f"expected NAME=VALUE items, got {item.strip()!r}")
        out[name.strip()] = raw.strip()
    return out


CommaList = Annotated[list[T], NoDecode, BeforeValidator(split_commas)]
"""A list given as ``a,b,c`` in a flag or env variable (a list from code)."""
TierMap = Annotated[dict[str, T], NoDecode, BeforeValidator(split_pairs)]
"""A mapping given as ``free=600,plus=6000`` in a flag or env variable (a dict from code)."""

P = TypeVar("P", str, Path)


def readable_file(value: P) -> P:
    """A file a process reads at start (keys, a policy, rules) must be there and readable when the
    settings are parsed: a mistyped path then stops the start with one line naming its flag, instead
    of a traceback from wherever the file is first opened (or, for a file read only in some modes,
    nothing at all until that mode is reached)."""
    path = Path(value)
    if not path.exists():
        raise ValueError(f"no such file {str(value)!r}")
    if not path.is_file():
        raise ValueError(f"{str(value)!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"cannot read {str(value)!r} (permission denied)")
    return value


InputFile = Annotated[str, AfterValidator(readable_file)]
"""A path to a file read at start (str-typed settings); validated by :func:`readable_file`."""
InputPath = Annotated[Path, AfterValidator(readable_file)]
"""The same for Path-typed settings."""


def readable_file_or_inline(value: str) -> str:
    """A policy flag's value: inline YAML as it is, else a file name checked by :func:`readable_file`."""
    return value if is_inline(value) else readable_file(value)


InputFileOrYaml = Annotated[str, AfterValidator(readable_file_or_inline)]
"""A policy given as a file or as inline YAML text (data_plane/common/yaml_source.py)."""


def _base(annotation: Any) -> Any:
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base(args[0]) if len(args) == 1 else str
    return annotation


def _env_names(cls: type[BaseSettings], name: str, field: Any) -> list[str]:
    prefix = cls.model_config.get("env_prefix", "")
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        names = [c.upper() for c in alias.choices if isinstance(c, str) and c != name]
        return [(prefix + name).upper(), *names] if name not in alias.choices else names or [(prefix + name).upper()]
    return [(prefix + name).upper()]


def _show_default(field: Any) -> str:
    if field.is_required():
        return "none: required"
    default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(default, (list, tuple)):
        return ",".join(str(v) for v in default) or "none"
    if isinstance(default, dict):
        return ",".join(f"{k}={v}" for k, v in default.items()) or "none"
    return "none" if default is None else str(default)


class _Deprecated(argparse.Action):
    """A deprecated spelling of a flag: stores into the same field, says so on stderr."""

    def __init__(self, option_strings: Sequence[str], dest: str, canonical: str = "", **kwargs: Any) -> None:
        self.canonical = canonical
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.canonical}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser(cls: type[BaseSettings], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of `cls`: one flag per field (help from its description), plus the
    deprecated spellings in ``cls.FLAG_ALIASES`` (``{"--old-flag": "field_name"}``); the fields in
    ``cls.ENV_ONLY`` (secrets that must stay out of ``ps``) get none; and the TLS flags every `switchboard`
    command takes (data_plane/common/tls.py), unless ``cls.TLS`` is False (a command that neither serves nor
    calls anything)."""
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip())
    env_only: frozenset[str] = getattr(cls, "ENV_ONLY", frozenset())
    for name, field in cls.model_fields.items():
        if name in env_only:
            continue
        flag = "--" + name.replace("_", "-")
        envs = " or ".join(_env_names(cls, name, field))
        help_text = f"{(field.description or '').strip()} [env {envs}; default {_show_default(field)}]"
        base = _base(field.annotation)
        if base is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, dest=name, choices=[str(c) for c in typing.get_args(base)], default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=base if base in (int, float) else str, default=None,
                                help=help_text)
    aliases: dict[str, str] = getattr(cls, "FLAG_ALIASES", {})
    for old, name in aliases.items():
        canonical = "--" + name.replace("_", "-")
        base = _base(cls.model_fields[name].annotation)
        if base is bool:
            parser.add_argument(old, dest=name, action="store_const", const=True, default=None,
                                help=f"deprecated spelling of {canonical}")
        else:
            parser.add_argument(old, dest=name, action=_Deprecated, canonical=canonical, default=None,
                                type=base if base in (int, float) else str, help=f"deprecated spelling of {canonical}")
    if getattr(cls, "TLS", True):
        add_tls_flags(parser)
    return parser


def parse_settings(cls: type[S], argv: list[str] | None, prog: str, description: str | None = None) -> S:
    """`cls` from flags, then its env variables, then defaults; a bad value exits 2 naming the flag."""
    return parse_flags(cls, argv, prog, description)[0]


def parse_flags(cls: type[S], argv: list[str] | None, prog: str,
                description: str | None = None) -> tuple[S, dict[str, Any]]:
    """`parse_settings`, plus the fields given as flags (``{field: raw value}``)."""
    ns = build_parser(cls, prog, description).parse_args(argv)
    overrides = {k: v for k, v in vars(ns).items() if v is not None}
    try:
        return cls(**overrides), overrides
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            why = err.get("ctx", {}).get("error") if err["type"] == "value_error" else None  # our own words
            print(f"{prog}: --{loc.replace('_', '-')}: {why or err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str] | None = None) -> None:
    """Run `commands[argv[0]]` (`name -> (module, description)`): the module is imported only now
    and its `main(rest_of_argv)` called; no argument or `--help` prints the table."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "\n".join([f"usage: {prog} COMMAND [ARGS...]", "", "commands:",
                       *(f"  {name:<15} {desc}" for name, (_, desc) in commands.items()),
                       "", f"run `{prog} COMMAND --help` for its flags"])
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage)
        return
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        raise SystemExit(2)
    importlib.import_module(commands[name][0]).main(rest)
