"""Kills one rank of a launched run with SIGKILL (or signals it) at a chosen point, from outside the script
under test.

A test puts this folder on PYTHONPATH and sets, for the launch:

- RECIPE_KILL_RANK: the global rank to kill;
- RECIPE_KILL_AT: where, one of `reduce_scatter:<n>` (on entering that rank's n-th gradient
  reduce-scatter, 1-based: mid-step, inside backward; `<n>,<m>`: at each, for a signal sent
  twice), `save:<path suffix>` (on entering the `torch.save` whose path ends with the suffix,
  after writing the first bytes of the file: a checkpoint half written; with a signal, the save
  goes on) or `rmtree:<path suffix>` (on returning from the `shutil.rmtree` of a
  folder whose path ends with the suffix: an old checkpoint just deleted).

Only the launch's first attempt is killed (TORCHELASTIC_RESTART_COUNT 0), so a restarted group
runs to the end. Other processes (the launcher, the elastic agent) are untouched, unless
RECIPE_KILL_SIGNAL names a signal (SIGTERM, SIGUSR1): that signal then goes, at the same point,
to the launcher (torch elastic's agent, the rank's parent), as a scheduler's warning before it
kills; with RECIPE_KILL_SIGNAL_TO=rank, to the rank itself.
"""

import os

if (
    os.environ.get("RECIPE_KILL_AT")
    and os.environ.get("RANK") == os.environ.get("RECIPE_KILL_RANK")
    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
):
    import signal

    _kind, _, _arg = os.environ["RECIPE_KILL_AT"].partition(":")

    _signal = os.environ.get("RECIPE_KILL_SIGNAL")

    def _die() -> None:
        if _signal is None:
            os.kill(os.getpid(), signal.SIGKILL)
        else:  # once: the run goes on to save and exit by itself
            target = os.getpid() if os.environ.get("RECIPE_KILL_SIGNAL_TO") == "rank" else os.getppid()
            os.kill(target, signal.Signals[_signal])

    if _kind == "reduce_scatter":
        import torch.distributed as dist

        _calls = [0]

        def _wrap(name: str) -> None:
            original = getattr(dist, name)

            def counted(*args, **kwargs):
                _calls[0] += 1
                if _calls[0] in {int(n) for n in _arg.split(",")}:
                    _die()
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        for _name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            _wrap(_name)
    elif _kind == "save":
        import torch

        _save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(_arg) and _signal is not None:
                _die()  # the signal during the save, which goes on
            elif isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(_arg):
                with open(f, "wb") as partial:  # what a write cut short leaves: a file, not the object
                    partial.write(b"PK\x03\x04")
                _die()
            return _save(obj, f, *args, **kwargs)

        torch.save = save
    elif _kind == "rmtree":
        import shutil

        _rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            _rmtree(path, *args, **kwargs)
            if os.fspath(path).rstrip(os.sep).endswith(_arg):
                _die()

        shutil.rmtree = rmtree
    else:
        raise ValueError(
            f"RECIPE_KILL_AT={os.environ['RECIPE_KILL_AT']!r}: use reduce_scatter:<n>, save:<path suffix> or "
            "rmtree:<path suffix>."
        )
