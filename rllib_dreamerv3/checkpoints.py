"""Crash-safe checkpoint directories: write aside, then rename; verify checksums on restore.

A checkpoint is written into a temporary sibling directory, completed with a manifest (size and
SHA-256 of every file, written last), and only then renamed to its path. Overwriting an
existing checkpoint moves the old directory aside first and deletes it after the rename, so a
process killed at any moment leaves either the old or the new checkpoint complete at `path`,
or, in the instant between the two renames, no directory at `path` and both complete ones
beside it: :func:`recover_interrupted_save` then puts the new one in place.

Restores verify the manifest first: a missing, truncated or altered file is an error that
names the file, raised before anything is loaded.
"""

import hashlib
import json
import logging
import os
import pathlib
import shutil
import uuid

MANIFEST = "dreamer_manifest.json"
MANIFEST_VERSION = 1
_TMP, _OLD = ".tmp-", ".old-"
_CHUNK = 1 << 22

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or does not fit the algorithm."""


def is_local(path):
    """Whether `path` is a path on this machine (not a `scheme://` URI)."""
    return "://" not in str(path)


def _sha256(file):
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory):
    return sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file())


def write_manifest(directory, info=None):
    """Record size and SHA-256 of every file below `directory`, plus `info` (JSON values)."""
    directory = pathlib.Path(directory)
    files = {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(directory)
        if p.name != MANIFEST
    }
    manifest = {"version": MANIFEST_VERSION, "files": files, "info": info or {}}
    tmp = directory / (MANIFEST + _TMP)
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory):
    """The manifest of a checkpoint directory, or None if it has none."""
    file = pathlib.Path(directory) / MANIFEST
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{file} is damaged ({err}); the checkpoint cannot be verified. "
            "Restore an earlier checkpoint."
        ) from None


def verify(directory, prefixes=None):
    """Check every file of the manifest against its size and checksum; returns the manifest.

    Raises `CheckpointError` naming the first missing, truncated or altered file. With
    `prefixes`, only the files whose relative paths start with one of them are checked (e.g.
    the policy's weights, without the replay buffer). A directory without a manifest (written
    by another program or an older version) is restored unverified, with a warning.
    """
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        logger.warning(
            "Checkpoint %s has no %s: its files cannot be verified.", directory, MANIFEST
        )
        return None
    for name, expected in manifest["files"].items():
        if prefixes is not None and not name.startswith(tuple(prefixes)):
            continue
        file = directory / name
        problem = None
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != expected["size"]:
            problem = f"has {file.stat().st_size} bytes, {expected['size']} were written"
        elif _sha256(file) != expected["sha256"]:
            problem = "does not match its checksum (the file was altered or damaged)"
        if problem:
            raise CheckpointError(
                f"Checkpoint file {file} {problem}. The checkpoint is not "
                "usable; restore an earlier one."
            )
    return manifest


def _siblings(path, marker):
    path = pathlib.Path(path)
    return sorted(path.parent.glob(f".{path.name}{marker}*"), key=lambda p: p.stat().st_mtime)


def recover_interrupted_save(path):
    """Finish a save that was killed between its two renames; remove what it left behind.

    If `path` is missing and a complete (manifest-verified) new copy stands beside it, the
    newest such copy is renamed to `path`. Leftover incomplete copies and moved-aside old
    copies are deleted once `path` holds a complete checkpoint.
    """
    path = pathlib.Path(path)
    if not path.parent.is_dir():
        return
    if not path.exists():
        for candidate in reversed(_siblings(path, _TMP)):
            try:
                if read_manifest(candidate) is not None and verify(candidate) is not None:
                    os.rename(candidate, path)
                    logger.warning("Completed the interrupted save of checkpoint %s.", path)
                    break
            except CheckpointError:
                continue
    if path.exists():
        for leftover in _siblings(path, _TMP) + _siblings(path, _OLD):
            shutil.rmtree(leftover, ignore_errors=True)


def save_atomically(path, write, info=None):
    """Write a checkpoint to `path` with `write(directory)`, so that a kill never leaves a torn
    directory at `path`; returns `path` as a string.

    `write` fills a fresh temporary directory beside `path`; the manifest (with `info`) is
    written last, then the directory replaces `path` by renames.
    """
    path = pathlib.Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(path)
    tag = uuid.uuid4().hex[:12]
    tmp = path.parent / f".{path.name}{_TMP}{tag}"
    try:
        write(tmp.as_posix())
        write_manifest(tmp, info)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}{_OLD}{tag}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path.as_posix()
