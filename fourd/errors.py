"""What fourd says to a user: the one exception they can meet, close-match suggestions, counts in
words."""

from __future__ import annotations

import difflib


class FourdError(Exception):
    """Bad input (config, layout, data, checkpoint, request): the message names the bad value and
    the fix."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RunFailed(FourdError):
    exit_code = 1  # a run that started and failed (a worker died or raised), not bad input


def did_you_mean(word: str, choices) -> str:
    """' (did you mean `x`?)' for the closest of `choices`, or '' when none is close."""
    close = difflib.get_close_matches(
        str(word), [str(choice) for choice in choices], n=1, cutoff=0.6
    )
    if not close:
        return ""
    return f" (did you mean `{close[0]}`?)"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """'1 microbatch', '4 microbatches', '1,024 ranks'."""
    if count == 1:
        word = noun
    elif many:
        word = many
    elif noun.endswith(("s", "sh", "ch", "x")):
        word = noun + "es"
    else:
        word = noun + "s"
    return f"{count:,} {word}"


def si(count: float) -> str:
    """A count with three significant digits and a K/M/B/T suffix: 6.31M, 8.03B, 406B, 950."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:.3g}"
