"""`kvfleet --help` explains every flag of every command (and builds without importing torch)."""

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

from services.cli import COMMANDS, build_parser, import_name_clash, main

pytestmark = pytest.mark.unit


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_command_is_registered():
    assert set(_subparsers(build_parser())) == set(COMMANDS)


def test_every_flag_has_help():
    missing = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"kvfleet {name} {'/'.join(action.option_strings) or action.dest}")
        for sub_name, sub in _subparsers(parser).items():
            walk(f"{name} {sub_name}", sub)

    for name, sub in _subparsers(build_parser()).items():
        walk(name, sub)
    assert not missing, "flags without help text:\n" + "\n".join(missing)


def test_help_does_not_import_torch():
    code = "import sys; from services.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_this_environment_has_no_package_with_the_kernels_import_name():
    """Hugging Face's hub `kernels` shares the import name of this repo's kernels/: with it installed,
    transformers imports ours in its place and every worker fails to load its model."""
    assert import_name_clash() is None


def test_an_installed_hub_kernels_package_stops_the_cli_with_what_to_do(monkeypatch, capsys):
    real = importlib.metadata.distribution

    class _Dist:
        version = "0.19.1"

    def distribution(name: str):
        return _Dist() if name == "kernels" else real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert "`kernels` 0.19.1" in err and "pip uninstall kernels" in err
