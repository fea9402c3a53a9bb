"""Whether a checkpoint directory proves itself: its manifest (every file present and every file the format
requires, with sizes and checksums), its ``meta.json`` read within limits, and its step. What
:class:`~flowrl.store.checkpoint.CheckpointStore` asks before it uses anything in a checkpoint; a failure
is an :class:`~flowrl.store.checkpoint_state.UnreadableCheckpoint` naming the check.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from flowrl.store.checkpoint_state import ROLES, TENSOR, UnreadableCheckpoint

#: the layout this flowrl writes and reads (1: workers.pt and weights.pt, before the checkpointer)
FORMAT = 2
MANIFEST = "manifest.json"

#: the largest meta.json read (a run's JSON state is kilobytes; a bigger file is not one this flowrl wrote)
META_MAX_BYTES = 64 << 20
#: a DCP shard file's name: the k-th of N a role's ranks wrote
_SHARD = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {bytes, sha256}}`` of every file under ``directory`` but the manifest."""
    out = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = file.relative_to(directory).as_posix()
        if rel != MANIFEST:
            out[rel] = {"bytes": file.stat().st_size, "sha256": sha256(file)}
    return out


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json, read within limits (size, nesting), as a mapping with the graph it belongs to."""
    file = path / "meta.json"
    try:
        if file.stat().st_size > META_MAX_BYTES:
            raise UnreadableCheckpoint(f"meta.json is {file.stat().st_size} bytes, more than any flowrl writes "
                                       f"({META_MAX_BYTES})")
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except UnreadableCheckpoint:
        raise
    except OSError as e:
        raise UnreadableCheckpoint(f"meta.json cannot be read ({e.strerror or e})") from None
    except RecursionError:
        raise UnreadableCheckpoint("meta.json is nested deeper than any flowrl writes") from None
    except ValueError as e:  # not UTF-8, not JSON, a number past Python's digit limit
        raise UnreadableCheckpoint(f"meta.json is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("graph"), dict):
        raise UnreadableCheckpoint("meta.json has no 'graph' mapping (the config the checkpoint belongs to)")
    return meta


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``, refused unless it has exactly the shape :meth:`CheckpointStore.save` writes."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"{MANIFEST} is missing; the checkpoint cannot be verified") from None
    except (OSError, ValueError, RecursionError) as e:
        raise UnreadableCheckpoint(f"{MANIFEST} is not readable JSON ({type(e).__name__}); the checkpoint "
                                   f"cannot be verified") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise UnreadableCheckpoint(f"{MANIFEST} is not a format-{FORMAT} manifest (a mapping with 'format' and "
                                   f"'files')")
    for rel, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str) and _HEX64.match(entry["sha256"])):
            raise UnreadableCheckpoint(f"{MANIFEST}'s entry for {rel!r} is not {{bytes, sha256}}")
    return files


def _required(meta: dict[str, Any], listed: set[str]) -> list[str]:
    """What the format requires that the manifest does not list: meta.json, the in-flight weights files,
    and for every role whose state holds tensors, a complete set of shard files (the k-th of N for
    every k) in each of its directories, at least one directory per role."""
    missing = [] if "meta.json" in listed else ["meta.json"]
    for entry in meta.get("weights") or []:
        if isinstance(entry, dict) and entry.get("file") not in listed:
            missing.append(str(entry.get("file")))
    states = meta.get("states")
    roles = {name for state in (states.values() if isinstance(states, dict) else [])
             if isinstance(state, dict) and isinstance(state.get("roles"), dict)
             for name, tree in state["roles"].items() if TENSOR in json.dumps(tree)}
    shards: dict[str, set[tuple[int, int]]] = {}
    for rel in listed:
        parts = rel.split("/")
        if len(parts) == 3 and parts[0] == ROLES and (m := _SHARD.match(parts[2])):
            shards.setdefault(parts[1], set()).add((int(m[1]), int(m[3])))
    for role in sorted(roles):
        dirs = [d for d in shards if d == role or d.startswith(f"{role}@")]
        if not dirs:
            missing.append(f"{ROLES}/{role}/ (no shard)")
        for d in dirs:
            counts = {n for _, n in shards[d]}
            n = max(counts)
            absent = sorted(set(range(1, n + 1)) - {k for k, _ in shards[d]})
            if absent or len(counts) > 1:
                missing.append(f"{ROLES}/{d}/ shard {absent[0] if absent else '?'} of {n}")
    return missing


def verify(path: Path, meta: dict[str, Any], steps: int) -> None:
    """The checkpoint is what its manifest says and the manifest is all the format needs, or it is unreadable."""
    files = _manifest(path)
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    if unlisted := sorted(on_disk - set(files)):
        raise UnreadableCheckpoint(f"{unlisted[0]} is not in {MANIFEST} ({len(unlisted)} file(s) unlisted)")
    if missing := _required(meta, set(files)):
        raise UnreadableCheckpoint(f"{MANIFEST} does not list {missing[0]}, which the checkpoint's format requires")
    for rel, entry in files.items():
        file = path / rel
        if not file.is_file():
            raise UnreadableCheckpoint(f"{rel} is missing (listed in {MANIFEST})")
        if file.stat().st_size != entry["bytes"] or sha256(file) != entry["sha256"]:
            raise UnreadableCheckpoint(f"{rel} is corrupt (its checksum differs from {MANIFEST})")
    if meta.get("step") != steps - 1:
        raise UnreadableCheckpoint(f"meta.json says it holds {meta.get('step')!r} + 1 steps, but its directory "
                                   f"{path.name} holds {steps} (a checkpoint moved or copied in)")


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
