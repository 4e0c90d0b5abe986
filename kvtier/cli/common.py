"""What every command shares: the typer app, one-line errors, option parsing and checks, JSON output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console


class OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a flag typer cannot parse, an unknown option) as one ``error:`` line and exit code 2, like
    every other bad input, instead of click's usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import sys

        from typer._click import exceptions as cx

        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else str(e))
            code = 2
        except cx.ClickException as e:
            msg = " ".join(e.format_message().split())
            where = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) is not None else ""
            err.print(f"[red]error:[/red] {msg}{where}", highlight=False, soft_wrap=True, markup=True)
            code = e.exit_code
        except (KeyboardInterrupt, EOFError):
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True,
                  help="Tiered KV cache for reasoning LLMs.")
console = Console()
err = Console(stderr=True)

MODEL_HELP = ("hub id, local dir, .gguf file, 'qwen2.5-coder-0.5b-instruct' (embedded, offline), "
              "'qwen2.5-coder-1.5b-instruct' (offline after make model-1.5b) or random:<preset>")
EMBEDDED = "qwen2.5-coder-0.5b-instruct"


def fail(msg: str) -> None:
    err.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


DEBUG = {"on": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="show Python tracebacks instead of one-line errors"),
          linear: Optional[str] = typer.Option(None, "--linear", help="how every command runs the model's step on "
                                               "CPU: auto (projections prepacked where measured faster, RMSNorms "
                                               "fused), packed, eager (stock F.linear and norms, bit for bit, for "
                                               "debugging); sets KVTIER_LINEAR")):
    """Tiered KV cache for reasoning LLMs."""
    DEBUG["on"] = debug
    if linear is not None:
        import os

        from ..step import LINEAR_MODES

        if linear not in LINEAR_MODES:
            raise typer.BadParameter(f"must be one of {list(LINEAR_MODES)}, got {linear!r}", param_hint="--linear")
        os.environ["KVTIER_LINEAR"] = linear  # child processes (Ray workers, eval shards) load models the same way


def run_command(fn):
    """Turn the library's user-facing errors into one line and exit code 2 (no traceback wall); anything
    unexpected is one line and exit code 1 (``--debug`` shows the traceback)."""
    from ..eval.datasets import DataError
    from ..models import ModelLoadError

    try:
        return fn()
    except typer.Exit:
        raise
    except (ValueError, ModelLoadError, DataError, NotImplementedError, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError) as e:
        if DEBUG["on"]:
            raise
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        err.print("interrupted; rerun the same command to resume", highlight=False)
        raise typer.Exit(130) from None
    except Exception as e:  # a bug: still one line, but not exit 2, so that it is not mistaken for bad input
        if DEBUG["on"]:
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        err.print(f"[red]error:[/red] internal error {type(e).__name__}: {first} (rerun with --debug for the traceback)",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option ``name`` on the command line (not its default)."""
    src = ctx.get_parameter_source(name)  # typer may bundle its own click: compare by name, not by class
    return getattr(src, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def check_limits(model: str, max_new_tokens: int) -> None:
    """What can be said about the model's positions before loading it."""
    from ..models import peek_position_limit

    lim = peek_position_limit(model)
    if lim is not None and max_new_tokens >= lim:
        raise ValueError(f"--max-new-tokens {max_new_tokens} does not fit {model}'s {lim} positions")


def parse_numbers(name: str, xs) -> list[float]:
    """Finite numbers from a flag or a config file; one clear error otherwise."""
    import math

    out = []
    for x in xs:
        try:
            v = float(x) if not isinstance(x, bool) else float("nan")
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be comma-separated numbers, got {x!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite numbers, got {x!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{name} needs at least one value")
    return out


def int_option(name: str, x) -> int:
    """An integer from a flag or a config file (``"128"`` or ``128``); a clear error otherwise."""
    if isinstance(x, bool):
        raise ValueError(f"{name} must be integers, got {x!r}")
    try:
        return int(str(x).strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {x!r}") from None


def parse_params(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            fail(f"--param must look like key=value, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def given_policy_params(**given) -> dict:
    """The policy options the user gave (the policy itself rejects the ones it does not take)."""
    return {k: v for k, v in given.items() if v is not None}


def default_max_new(device: str) -> int:
    from ..models import resolve_device

    return 4096 if resolve_device(device).type == "cuda" else 512


def max_new_or_default(value: int | None, device: str) -> int:
    """``None`` means not given (the device's default); 0 or less is an error, never "the default"."""
    return default_max_new(device) if value is None else value


def check_json_out(path: Path) -> None:
    """--json must name a file we can write, checked before minutes of benchmarking."""
    if path.is_dir() or str(path).endswith(("/", "\\")):
        raise ValueError(f"--json {path} is a directory; give a file name, e.g. {path / 'bench.json'}")
    from ..eval.records import check_parents

    check_parents(path, "--json")


def write_json(path: Path, obj: dict) -> None:
    """Written aside and renamed: an interrupted write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)
