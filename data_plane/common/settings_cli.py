"""Flags from a settings class: each field is an env var (via pydantic-settings) and a flag.

    class ShardSettings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_SHARD_")
        port: int = Field(8101, ge=1, le=65535, description="TCP port to listen on.")

    settings = parse_settings(ShardSettings, argv, prog="switchboard shard")
    # precedence: flag > environment variable > default; validated once, here

    dispatch("switchboard", {"shard": ("data_plane.shard.app", "run one shard")}, argv)   # subcommands
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def _flag_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if typing.get_origin(base) is typing.Literal:
        return str
    return base if base in (int, float, str) else str


def parse_settings(cls: type[S], argv: list[str] | None, prog: str, description: str | None = None) -> S:
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip())
    prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = (prefix + name).upper()
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        help_text = f"{field.description or ''} [env {env}; default {default!r}]"
        annotation = field.annotation
        if annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=_flag_type(annotation), default=None, help=help_text)
    ns = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(ns).items() if v is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            print(f"{prog}: --{loc.replace('_', '-')}: {err['msg']}", file=sys.stderr)
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
