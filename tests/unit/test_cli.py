"""`kvfleet --help` explains every flag of every command (and builds without importing torch)."""

import argparse
import subprocess
import sys

import pytest

from services.cli import COMMANDS, build_parser

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
