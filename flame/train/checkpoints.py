"""Training checkpoints: one folder per step, written atomically, the newest K kept.

``save_checkpoint(root, step, writers)`` writes every file into a temporary folder beside the
final one (each file fsynced by its writer), fsyncs that folder, renames it to
``root/step-NNNNNNNN`` and fsyncs ``root``; only then does it write the completion marker
``COMPLETE`` (fsynced). A checkpoint without the marker (a crash mid-save) is never resumed from.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile

from ..io import atomic_write, fsync_dir

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8,})$")


def checkpoint_path(root, step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{int(step):08d}")


def list_checkpoints(root) -> list:
    """[(step, path)] of the complete checkpoints under ``root``, oldest first."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MARKER)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(root) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(root, step: int, writers: dict, keep_last: int | None = None) -> str:
    """Write a checkpoint for ``step``: ``writers`` maps file names to ``write(path)`` callables,
    each of which must write and fsync its file. Returns the checkpoint folder. A complete
    checkpoint of the same step is kept as it is (nothing was trained since it was written)."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    final = checkpoint_path(root, step)
    if os.path.isfile(os.path.join(final, MARKER)):
        return final
    tmp = tempfile.mkdtemp(prefix=f".tmp-step-{int(step):08d}-", dir=root)
    try:
        for name, write in writers.items():
            write(os.path.join(tmp, name))
        fsync_dir(tmp)
        if os.path.exists(final):  # an incomplete one left by a crash
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    atomic_write(os.path.join(final, MARKER), lambda f: f.write(f"{int(step)}\n".encode()))
    fsync_dir(final)
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def prune_checkpoints(root, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and leftovers of crashed saves."""
    root = os.fspath(root)
    complete = list_checkpoints(root)
    for _, path in complete[:max(0, len(complete) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)
    keep = {p for _, p in complete}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if (name.startswith(".tmp-step-") or _NAME.match(name)) and path not in keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
