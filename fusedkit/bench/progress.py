"""Progress bars for the reports: tqdm's, on a terminal only; a no-op where tqdm is missing."""

from __future__ import annotations

import sys


class _Quiet:
    """What a report calls when there is no bar to draw."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, desc: str, enabled: bool = True):
    """A progress bar over ``total`` steps on stderr. ``disable=None`` lets tqdm hide it when
    stderr is not a terminal (a log file, CI), so logs stay free of redraws."""
    if not enabled:
        return _Quiet()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Quiet()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)
