"""Typed configuration: dataclasses whose fields carry their help text, settable alike from
command-line flags and `KVBRIDGE_<SERVICE>_*` environment variables (flags win), validated at
construction.

    @dataclasses.dataclass(frozen=True)
    class FooConfig:
        env_prefix: ClassVar[str] = "KVBRIDGE_FOO_"
        listen: str = setting("127.0.0.1:50051", "host:port to serve gRPC on")

    @click.command()
    @config_options(FooConfig)          # adds --listen, reading KVBRIDGE_FOO_LISTEN too
    def serve(**kw): cfg = build_config(FooConfig, kw)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

T = TypeVar("T")
ENV_PREFIX = "KVBRIDGE_"


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console", "auto")


def check_logging(level: str, fmt: str) -> None:
    """Validate a service's log_level and log_format settings."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level must be {'|'.join(LOG_LEVELS)}, got {level!r}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format must be {'|'.join(LOG_FORMATS)}, got {fmt!r}")


def setting(default: Any, help: str, *, env: str | None = None) -> Any:
    """A config field with its help text (and optionally an explicit env var name)."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env})


def env_name(field: dataclasses.Field[Any], cls: type[Any] | None = None) -> str:
    """`KVBRIDGE_<SERVICE>_<FIELD>`: the class's `env_prefix` (a ClassVar) plus the name."""
    prefix = getattr(cls, "env_prefix", ENV_PREFIX) if cls is not None else ENV_PREFIX
    return str(field.metadata.get("env") or prefix + field.name.upper())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_options(cls: type[Any], *, exclude: tuple[str, ...] = ()) -> Callable[[T], T]:
    """Click options for every field of config dataclass `cls`, each also read from its env var."""

    def decorate(fn: T) -> T:
        for field in reversed(dataclasses.fields(cls)):
            if field.name in exclude:
                continue
            default = field.default
            kind: Any = type(default) if default is not None else str
            help_text = (f"{field.metadata.get('help', '')} "
                         f"[env {env_name(field, cls)}; default {default}]")
            if kind is bool:
                opt = click.option(
                    _flag(field.name) + "/--no-" + field.name.replace("_", "-"),
                    field.name, default=None, envvar=env_name(field, cls), help=help_text,
                )
            else:
                # click ignores an empty variable, but for a text setting empty is a value
                # (e.g. metrics_listen "" disables metrics): read it as the default then.
                env_default = (functools.partial(os.environ.get, env_name(field, cls))
                               if kind is str else None)
                opt = click.option(
                    _flag(field.name), field.name, type=kind, default=env_default,
                    envvar=env_name(field, cls), help=help_text, show_envvar=False,
                )
            fn = opt(fn)  # type: ignore[type-var]  # click's decorator typing wants FC
        return fn

    return decorate


def build_config(cls: type[T], values: Mapping[str, Any]) -> T:
    """Construct `cls` from parsed options, leaving unset ones (None) at their defaults.

    Raises click.BadParameter naming the flag when validation fails, so the CLI prints a clear
    error instead of a traceback.
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in values.items() if k in names and v is not None}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
