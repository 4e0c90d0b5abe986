"""The one table of environment switches: every KVTIER_ name the package mentions is declared in kvtier/env.py and
read nowhere else; a bad value is one error naming the variable and its values, where it is read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier import env

PKG = Path(__file__).resolve().parents[1] / "kvtier"
SOURCES = [p for p in PKG.rglob("*.py") if p.name != "env.py" or p.parent != PKG]


def test_every_kvtier_name_in_the_package_is_declared():
    named = {m for p in SOURCES for m in re.findall(r"\bKVTIER_[A-Z0-9_]*[A-Z0-9]", p.read_text(encoding="utf-8"))}
    assert named, "the scan found no KVTIER_ name at all"
    assert named <= set(env.SWITCHES), f"used but not declared in kvtier/env.py: {sorted(named - set(env.SWITCHES))}"


def test_no_module_but_env_reads_the_environment_for_a_switch():
    read = re.compile(r"""(?:environ\.get|getenv)\(\s*["']KVTIER_|environ\[\s*["']KVTIER_\w+["']\s*\](?!\s*=[^=])""")
    readers = [str(p.relative_to(PKG)) for p in SOURCES if read.search(p.read_text(encoding="utf-8"))]
    assert readers == [], f"read KVTIER_ variables directly (use kvtier.env): {readers}"


@pytest.mark.parametrize("name, bad, reader", [
    ("KVTIER_KERNEL", "fused", lambda: env.choice("KVTIER_KERNEL")),
    ("KVTIER_LINEAR", "fast", lambda: __import__("kvtier.step", fromlist=["linear_mode"]).linear_mode()),
    ("KVTIER_LINEAR_KERNEL", "amx", lambda: env.choice("KVTIER_LINEAR_KERNEL")),
    ("KVTIER_MALLOC", "jemalloc", lambda: __import__("kvtier.step.malloc", fromlist=["x"]).malloc_mode()),
    ("KVTIER_DIRECT", "maybe", lambda: __import__("kvtier.step.decode", fromlist=["x"]).enabled()),
    ("KVTIER_LOG", "loud", lambda: env.choice("KVTIER_LOG")),
    ("KVTIER_PROGRESS_INTERVAL", "-1", lambda: __import__("kvtier.cli.progress", fromlist=["x"]).progress_interval()),
    ("KVTIER_PROGRESS_INTERVAL", "soon", lambda: env.seconds("KVTIER_PROGRESS_INTERVAL")),
    ("KVTIER_KERNEL_MARCH", "-O0 evil", lambda: env.march()),
])
def test_a_bad_value_is_one_error_naming_the_variable_and_its_values(monkeypatch, name, bad, reader):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError) as e:
        reader()
    msg = str(e.value)
    assert msg.startswith(name) and repr(bad) in msg and env.SWITCHES[name].allowed() in msg


def test_defaults_and_the_shared_on_off_words(monkeypatch, tmp_path):
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert env.choice("KVTIER_KERNEL") == "auto" and env.on("KVTIER_DIRECT") and env.seconds(
        "KVTIER_PROGRESS_INTERVAL") == 10 and env.march() == "native"
    for word in env.ON + tuple(w.upper() for w in env.ON):
        monkeypatch.setenv("KVTIER_DIRECT", word)
        assert env.on("KVTIER_DIRECT")
    for word in env.OFF:
        monkeypatch.setenv("KVTIER_DIRECT", f" {word} ")
        assert not env.on("KVTIER_DIRECT")
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))  # the kernels follow the cache unless told otherwise
    assert env.kernel_dir() == tmp_path / "kernels"
    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path / "k"))
    assert env.kernel_dir() == tmp_path / "k"
    with pytest.raises(KeyError, match="not a declared switch"):
        env.raw("KVTIER_NOPE")


def test_a_bad_log_level_stops_the_command_line_in_one_line(monkeypatch, capsys):
    from kvtier.cli import main

    monkeypatch.setenv("KVTIER_LOG", "loud")
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: KVTIER_LOG must be one of debug | info")
