"""Crash-safe checkpoint directories: write aside, then rename; verify checksums on restore.

A checkpoint is written into a temporary sibling directory, completed with a manifest (size and
SHA-256 of every file, written last), and only then renamed to its path. Overwriting an
existing checkpoint moves the old directory aside first and deletes it after the rename, so a
process killed at any moment leaves either the old or the new checkpoint complete at `path`,
or, in the instant between the two renames, no directory at `path` and both complete ones
beside it: :func:`recover_interrupted_save` then puts the new one in place.

Restores verify the manifest first: a missing, truncated or altered file is an error that
names the file, raised before anything is loaded. Large files that a restore reads anyway (the
replay buffer's chunks) are checked as they are read (:func:`read_verified`), so no byte is
read twice. A checkpoint without a manifest is refused unless the environment variable
`RLLIB_DREAMERV3_ALLOW_UNVERIFIED_CHECKPOINTS=1` allows it (checkpoints written before
manifests existed).
"""

import hashlib
import json
import logging
import os
import pathlib
import shutil
import uuid

MANIFEST = "dreamer_manifest.json"
ALLOW_UNVERIFIED = "RLLIB_DREAMERV3_ALLOW_UNVERIFIED_CHECKPOINTS"
MANIFEST_VERSION = 1
_TMP, _OLD = ".tmp-", ".old-"
_CHUNK = 1 << 22

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or does not fit the algorithm."""


def is_local(path, filesystem=None):
    """Whether `path` is a path on this machine: no `scheme://` URI, and no filesystem or a
    local one (pyarrow's `LocalFileSystem`, which RLlib passes along for local paths)."""
    local_fs = filesystem is None or type(filesystem).__name__ == "LocalFileSystem"
    return local_fs and "://" not in str(path)


def _sha256(file):
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory):
    return sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file())


def entry(data):
    """The manifest entry of a file whose bytes are `data`."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(directory, info=None, known=None):
    """Record size and SHA-256 of every file below `directory`, plus `info` (JSON values).

    `known` maps relative paths to entries the caller already has (files it just wrote, or
    hard links of files an earlier manifest lists): those files are not read again.
    """
    directory = pathlib.Path(directory)
    known = known or {}
    files = {}
    for p in _files(directory):
        name = p.relative_to(directory).as_posix()
        if p.name != MANIFEST:
            files[name] = known.get(name) or {"size": p.stat().st_size, "sha256": _sha256(p)}
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


def _unverified_allowed():
    return os.environ.get(ALLOW_UNVERIFIED, "") not in ("", "0")


def require_manifest(directory):
    """The manifest of `directory`; without one, a `CheckpointError` that says how to restore
    it anyway, or None (with a warning) where `RLLIB_DREAMERV3_ALLOW_UNVERIFIED_CHECKPOINTS=1`."""
    manifest = read_manifest(directory)
    if manifest is not None:
        return manifest
    if _unverified_allowed():
        logger.warning("Checkpoint %s has no %s: restored unverified.", directory, MANIFEST)
        return None
    raise CheckpointError(
        f"Checkpoint {directory} has no {MANIFEST}: its files cannot be verified. Every "
        "checkpoint this package writes has one, so the save was incomplete or the file was "
        "deleted; restore an earlier checkpoint. To restore it unverified (a checkpoint of a "
        f"version without manifests), set the environment variable {ALLOW_UNVERIFIED}=1."
    )


def _problem(file, expected, data=None):
    """Why `file` (or its bytes `data`, when already read) does not match its manifest entry."""
    if data is None and not file.is_file():
        return "is missing"
    size = len(data) if data is not None else file.stat().st_size
    if size != expected["size"]:
        return f"has {size} bytes, {expected['size']} were written"
    digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256(file)
    if digest != expected["sha256"]:
        return "does not match its checksum (the file was altered or damaged)"
    return None


def _damaged(file, problem):
    return CheckpointError(
        f"Checkpoint file {file} {problem}. The checkpoint is not usable; restore an earlier one."
    )


def verify(directory, prefixes=None, skip=()):
    """Check every file of the manifest against its size and checksum; returns the manifest.

    Raises `CheckpointError` naming the first missing, truncated or altered file. With
    `prefixes`, only the files whose relative paths start with one of them are checked (e.g.
    the policy's weights, without the replay buffer); files under the prefixes in `skip` are
    left to :func:`read_verified`. A directory without a manifest is refused (see
    :func:`require_manifest`).
    """
    directory = pathlib.Path(directory)
    manifest = require_manifest(directory)
    if manifest is None:
        return None
    for name, expected in manifest["files"].items():
        if prefixes is not None and not name.startswith(tuple(prefixes)):
            continue
        if skip and name.startswith(tuple(skip)):
            continue
        problem = _problem(directory / name, expected)
        if problem:
            raise _damaged(directory / name, problem)
    return manifest


def read_verified(directory, name, manifest):
    """The bytes of file `name` of a checkpoint, checked against `manifest` as they are read
    (a `CheckpointError` names a file that is missing, or not in the manifest, or damaged)."""
    file = pathlib.Path(directory) / name
    if manifest is not None and name not in manifest["files"]:
        raise _damaged(file, f"is not in {MANIFEST}")
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise _damaged(file, "is missing") from None
    problem = manifest and _problem(file, manifest["files"][name], data)
    if problem:
        raise _damaged(file, problem)
    return data


# Files below these directories are checked as a restore reads them (:func:`read_verified`):
# the replay buffer's chunks, the bulk of a checkpoint.
REPLAY_DIR = "replay_buffer"
CHECKED_WHEN_READ = (REPLAY_DIR + "/",)
_CTOR_FILE = "class_and_ctor_args.pkl"  # RLlib's pickle of the class and its config
_ALGORITHM = b"rllib_dreamerv3.algorithm"  # how a pickle names DreamerV3's module
# realpath -> (manifest's stat, manifest) of checks whose restore has not run yet.
_checked = {}


def _manifest_stat(path):
    stat = (pathlib.Path(path) / MANIFEST).stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _enclosing_checkpoint(path, levels=6):
    """`(checkpoint directory, relative prefix)` of the nearest directory above `path` that has
    a manifest (a component of a checkpoint, e.g. its RLModule), or None."""
    path = pathlib.Path(path).absolute()
    for parent in list(path.parents)[:levels]:
        if (parent / MANIFEST).is_file():
            return parent, path.relative_to(parent).as_posix() + "/"
    return None


def check_before_restore(path):
    """Before RLlib reads anything of the local checkpoint `path`: finish an interrupted save,
    then verify its files (but those of `CHECKED_WHEN_READ`), so that a damaged checkpoint is
    named before an algorithm is built for it.

    A component of a checkpoint (e.g. `.../learner_group/learner/rl_module/default_policy`) is
    checked against the manifest of the checkpoint that holds it. An algorithm checkpoint of
    this package (its constructor pickle names `rllib_dreamerv3.algorithm`) must have a
    manifest (see :func:`require_manifest`); others are checked only if they have one. The
    restore that follows in this process does not read the files again
    (:func:`verify_for_restore`).
    """
    path = pathlib.Path(path)
    recover_interrupted_save(path)
    if not path.is_dir():
        return
    if read_manifest(path) is None:
        enclosing = _enclosing_checkpoint(path)
        if enclosing is not None:
            verify(enclosing[0], prefixes=(enclosing[1],), skip=CHECKED_WHEN_READ)
            return
        ctor = path / _CTOR_FILE
        if not (ctor.is_file() and _ALGORITHM in ctor.read_bytes()):
            return
    manifest = verify(path, skip=CHECKED_WHEN_READ)
    if manifest is not None:
        _checked[os.path.realpath(path)] = (_manifest_stat(path), manifest)


def verify_for_restore(path):
    """`verify(path, skip=CHECKED_WHEN_READ)`, unless :func:`check_before_restore` verified
    the same manifest since the last restore of `path` in this process; returns the manifest."""
    stat, manifest = _checked.pop(os.path.realpath(path), (None, None))
    if stat is not None and os.path.isfile(os.path.join(path, MANIFEST)):
        if _manifest_stat(path) == stat:
            return manifest
    return verify(path, skip=CHECKED_WHEN_READ)


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

    `write` fills a fresh temporary directory beside `path` and may return the manifest entries
    of files it wrote (see :func:`write_manifest`'s `known`); the manifest (with `info`) is
    written last, then the directory replaces `path` by renames.
    """
    path = pathlib.Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(path)
    tag = uuid.uuid4().hex[:12]
    tmp = path.parent / f".{path.name}{_TMP}{tag}"
    try:
        known = write(tmp.as_posix())
        write_manifest(tmp, info, known if isinstance(known, dict) else None)
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
