"""The command lines' parser: each error in one line, naming the nearest valid choice, and
every option's default in `--help`.

argparse answers a typo with the whole usage and a list of choices (`--strategy zero-3`:
22 lines); a reader needs one line and the name they meant. `Parser` is argparse with that
`error`, used by every `python -m shardlab` command. It imports no torch, so a misspelt
command line is answered before torch is imported (which takes seconds).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from shardlab.vocabulary import nearest


def worth_showing(default: Any) -> bool:
    """Whether `--help` says a default: not for None, a switch that is off, or nothing."""
    return not (default is None or default is False or default == []
                or default is argparse.SUPPRESS)


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option's text with its default, where it has one worth saying
    (not None, not a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or not worth_showing(default) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """argparse, with one line per error: `PROG: error: --strategy 'zero-3' is not one of
    its choices (did you mean zero3?): ddp, ddp-naive, ...`, exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsShown)
        self.flags: list[str] = []  # before argparse adds --help
        self.choices_of: dict[str, list[str]] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if "help" not in kwargs and worth_showing(kwargs.get("default")):
            kwargs["help"] = "default: %(default)s"  # argparse shows no help without text
        action = super().add_argument(*args, **kwargs)
        self.flags += action.option_strings
        if action.choices is not None:
            for name in action.option_strings or [action.dest]:
                self.choices_of[name] = [str(c) for c in action.choices]
        return action

    def error(self, message: str):
        self.refuse(self.explain(message))

    def refuse(self, line: str):
        """Exit 2 with `line`, said as this command's error."""
        print(f"{self.prog}: error: {line}", file=sys.stderr)
        sys.exit(2)

    def explain(self, message: str) -> str:
        """argparse's message in one line, with the nearest choice or flag."""
        choice = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '?([^' ]*)'?", message)
        if choice:
            flag, value = choice[1], choice[2]
            choices = self.choices_of.get(flag, [])
            close = nearest(value, choices)
            hint = f" (did you mean {close}?)" if close else ""
            return f"{flag} {value!r} is not one of its choices{hint}: {', '.join(choices)}"
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            word = unknown[1]
            close = nearest(word.split("=")[0], self.flags) if word.startswith("-") else None
            hint = f" (did you mean {close}?)" if close else ""
            return f"unknown argument {word!r}{hint}; {self.prog} --help lists them"
        return " ".join(message.split()) + f"; {self.prog} --help says more"


def key_value(text: str) -> tuple[str, Any]:
    """`--option key=value`: the value as an int, a float, True/False, or the text."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"takes key=value, got {text!r}")
    key, value = text.split("=", 1)
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)
