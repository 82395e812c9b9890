"""Checks that a command can write where it was told to, made before it loads anything, and
`write_atomic`, how its small files are then written.

The rule for every command that writes files (docs/files.md): validate everything, then write.
These checks create nothing that outlives them: a probe file is created and removed at once.
"""

from __future__ import annotations

import os
import tempfile

from specjax.errors import SpecjaxError


def check_dir_writable(directory: str, what: str) -> None:
    """Refuse a directory this process cannot create files in: permissions first, then a probe
    file, created and removed (read-only mounts, /sys and /proc pass the permission check as
    root)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SpecjaxError(f"{what}: directory {directory} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".specjax-probe-", dir=directory)
    except OSError as e:
        raise SpecjaxError(f"{what}: cannot create files in {directory} ({e.strerror or e})") from None
    os.close(fd)
    os.remove(probe)


def check_can_create_dir(path: str, what: str) -> None:
    """Refuse a directory that neither exists and is writable nor can be created (its nearest
    existing ancestor must be a writable directory). Creates nothing."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecjaxError(f"{what}: {path} exists and is not a directory")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise SpecjaxError(f"{what}: cannot create {path}: {probe} is not a directory")
    check_dir_writable(probe, what)


def check_file_writable(path: str, what: str) -> None:
    """Refuse a file path that cannot be written: a directory, a read-only file, or one in a
    directory that is missing or not writable. Creates nothing."""
    if os.path.isdir(path):
        raise SpecjaxError(f"{what}: {path} is a directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SpecjaxError(f"{what}: {path} is not writable")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise SpecjaxError(f"{what}: directory {parent} does not exist")
    check_dir_writable(parent, what)


def write_atomic(path: str, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename: readers see all or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
