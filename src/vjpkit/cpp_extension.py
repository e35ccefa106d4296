"""C++ kernels for JAX, compiled from a source string: ``load_inline``.

For example (not run as a doctest, unlike the examples of the rest of the
API: it needs a C++ compiler, and compiling takes seconds;
tests/test_cpp_extension.py builds and runs the same kernel):

```python
import jax, jax.numpy as jnp, numpy as np
from vjpkit import cpp_extension

source = r'''
namespace ffi = xla::ffi;

ffi::Error ScaleImpl(float factor, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = factor * x.typed_data()[i];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(Scale, ScaleImpl,
    ffi::Ffi::Bind().Attr<float>("factor").Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
'''
ext = cpp_extension.load_inline("scale", source, functions=["Scale"], vmap_method="broadcast_all")

x = jnp.arange(4.0)
y = ext.Scale(x, result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype), factor=np.float32(3.0))
jax.jit(jax.vmap(lambda r: ext.Scale(r, result_shape_dtypes=r, factor=np.float32(2.0))))(jnp.ones((3, 4)))
```

This is PyTorch's ``torch.utils.cpp_extension.load_inline`` for XLA's FFI:
the source is compiled once into a shared library, cached by a hash of its
content, each handler named in ``functions`` is registered as an XLA FFI
target for the CPU (those of a ``cuda_source``: for CUDA GPUs), and the returned `Extension` has one callable
per handler that runs it through ``jax.ffi.ffi_call``. The calls work under
``jit``, ``vmap`` and inside vjpkit Functions (wrap a forward and a backward
kernel in one Function to give the kernel a gradient).

The key differences to PyTorch's ``load_inline``:

- Kernels are XLA FFI handlers, not pybind11 functions: write them with
  ``XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, Impl, binding)`` from
  ``xla/ffi/api/ffi.h`` (included for you, from the headers jaxlib ships),
  and name them in ``functions``. A handler's arguments are buffers plus
  attributes (keyword arguments at the call, as NumPy scalars of the
  declared type: ``np.float32(1e-5)`` for ``Attr<float>``).
- JAX cannot infer a kernel's output shapes: each call names them with
  ``result_shape_dtypes`` (one ``jax.ShapeDtypeStruct`` or an array to copy
  the shape and dtype from, or a sequence of them for several outputs).
- Batching under ``vmap`` is declared, not discovered: ``vmap_method``
  (per extension, or per call) says how JAX batches the call;
  ``"sequential"`` (the default) loops over the batch and is right for any
  kernel; ``"broadcast_all"`` passes the whole batch as a leading axis of
  every argument in one call, right for kernels that treat leading axes as
  independent rows (``"expand_dims"``: the same, with size-1 axes for
  unbatched arguments).
- FFI calls have no derivative: give them one with a vjpkit Function whose
  forward and backward each call a kernel (``examples/ffi_kernel.py``).
- CUDA kernels: ``cuda_source=`` (PyTorch's ``cuda_sources=`` too) is
  compiled with ``nvcc`` into a second library whose handlers are
  registered for CUDA GPUs (``examples/cuda_kernel.py``); a handler takes
  XLA's stream with ``.Ctx<ffi::PlatformStream<cudaStream_t>>()``. A kernel
  runs only on the platforms it was compiled for: called eagerly on arrays
  of another device it raises ``ValueError`` naming both.

Tips:

- The compiler is ``$CXX``, else the first of ``c++``, ``g++`` and
  ``clang++`` on the ``PATH``, run directly (no setuptools): one command,
  ``-std=c++17 -O2 -fPIC -shared`` plus ``$CPPFLAGS``, ``$CXXFLAGS`` and
  ``extra_cflags``, then ``$LDFLAGS`` and ``extra_ldflags``. The library
  links to neither Python nor NumPy, so it does not depend on their ABI.
- Libraries are cached under ``$VJPKIT_EXTENSIONS_DIR``, else
  ``$XDG_CACHE_HOME/vjpkit/cpp_extensions`` (``~/.cache/...``); delete the
  directory to rebuild everything. ``build_directory=`` overrides it.
- The cache key holds everything the library depends on: the source, the
  flags, the compiler (its path, size and modification time), the FFI
  headers, JAX's version, and the platform and CPU architecture
  (``platform.machine()``), so one cache directory can serve several
  machines, and a notebook can edit the source and call ``load_inline``
  again.
- A cached library that cannot be loaded (a truncated or empty file) is
  built again. A cached library (or its directory) owned by another user,
  or writable by group or others, is refused: loading it runs its code in
  this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

import jax

from . import _jax_internals
from ._host import VMAP_METHODS

__all__ = ["BuildError", "Extension", "FfiKernel", "default_build_directory", "load_inline"]

_SOURCE_PREFIX = '#include "xla/ffi/api/ffi.h"\n#line 1 "<cpp_source>"\n'
_CUDA_SOURCE_PREFIX = '#include "xla/ffi/api/ffi.h"\n#line 1 "<cuda_source>"\n'
_CXX_FLAGS = ("-std=c++17", "-O2")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HANDLER_SYMBOL = re.compile(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)")
_COMPILERS = ("c++", "g++", "clang++")  # tried in this order when $CXX is not set

# One build at a time in this process (other processes: see _Compiler.build).
_lock = threading.Lock()
_registered: set[tuple[str, str]] = set()  # the XLA FFI targets (and platforms) registered in this process
# XLA's platform names for registering, and JAX's device platform for each.
_DEVICE_PLATFORM = {"cpu": "cpu", "CUDA": "gpu"}


class BuildError(RuntimeError):
    """The C++ source could not be built: no compiler, or the compiler failed (its output is in the message)."""


class FfiKernel:
    """One FFI handler of an `Extension`, registered as an XLA target for the CPU.

    Call it with the kernel's buffers as positional arguments and its
    attributes as keyword arguments, for example (not a doctest: it needs
    a kernel compiled by `load_inline`, with a C++ compiler; see the
    module's example):

    ```python
    y = ext.Scale(x, result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype), factor=np.float32(3.0))
    ```

    Returns one array, or a list of arrays when ``result_shape_dtypes`` is a
    sequence.

    Attributes:
        name: The function's name (as given in ``functions``).
        target_name: The XLA FFI target it is registered as (the extension's
            name as a prefix).
        vmap_method: How calls batch under ``jax.vmap`` unless a call says
            otherwise.
        platforms: XLA's names of the platforms it is compiled for:
            ``"cpu"`` (``cpp_source``), ``"CUDA"`` (``cuda_source``).
    """

    def __init__(self, name: str, target_name: str, vmap_method: str, platforms: Sequence[str] = ("cpu",)):
        """Made by `load_inline`, one per registered function."""
        self.name = name
        self.target_name = target_name
        self.vmap_method = vmap_method
        self.platforms = tuple(platforms)  # XLA's names: "cpu" (cpp_source), "CUDA" (cuda_source)

    def __call__(
        self, *args: Any, result_shape_dtypes: Any, vmap_method: str | None = None, **attributes: Any
    ) -> Any:
        """Calls the kernel on ``args`` (its buffers), its ``attributes`` passed as keywords."""
        method = self.vmap_method if vmap_method is None else _checked_vmap_method(vmap_method)
        self._check_devices(args)
        call = _jax_internals.ffi_api().ffi_call(self.target_name, _shape_dtypes(result_shape_dtypes), method)
        return call(*args, **attributes)

    def _check_devices(self, args: Sequence[Any]) -> None:
        """An array on a device this kernel was not compiled for raises here, naming both (not XLA's NOT_FOUND)."""
        compiled_for = {_DEVICE_PLATFORM[p] for p in self.platforms}
        for arg in args:
            if isinstance(arg, jax.Array) and not isinstance(arg, jax.core.Tracer):
                on = {d.platform for d in arg.devices()} - compiled_for
                if on:
                    sources = " and ".join({"cpu": "cpp_source", "gpu": "cuda_source"}[p] for p in sorted(compiled_for))
                    raise ValueError(
                        f"{self.name} is compiled for {', '.join(sorted(compiled_for))} only (from load_inline's "
                        f"{sources}), but an argument is on {', '.join(sorted(on))}. Put the arguments on a "
                        f"{' or '.join(sorted(compiled_for))} device (jax.device_put(x, "
                        f"jax.devices({sorted(compiled_for)[0]!r})[0]), or jax.default_device), or give "
                        "load_inline a source for that platform."
                    )

    def __repr__(self) -> str:
        """The kernel's name, target, batching and platforms."""
        return (f"FfiKernel({self.name!r}, target_name={self.target_name!r}, vmap_method={self.vmap_method!r}, "
                f"platforms={self.platforms!r})")


class Extension:
    """A compiled C++ source: one `FfiKernel` attribute per name in ``functions``.

    Attributes:
        name: The extension's name (``load_inline``'s ``name``).
        library_path: The compiled shared library, in the build directory's
            cache.
        functions: The kernels by name, as ``{name: FfiKernel}``.
    """

    def __init__(self, name: str, library_path: pathlib.Path, kernels: dict[str, FfiKernel]):
        """Made by `load_inline`."""
        self.name = name
        self.library_path = library_path
        self.functions = dict(kernels)

    def __getattr__(self, attribute: str) -> FfiKernel:
        """The kernel named ``attribute``; an unknown name raises, listing the extension's functions."""
        functions = self.__dict__.get("functions", {})
        if attribute in functions:
            return functions[attribute]
        raise AttributeError(
            f"extension {self.__dict__.get('name')!r} has no function {attribute!r}; "
            f"its functions are {sorted(functions)} (add a name to load_inline's functions= to register it)"
        )

    def __dir__(self) -> list[str]:
        """The attributes, the kernels' names among them."""
        return sorted({*super().__dir__(), *self.functions})

    def __repr__(self) -> str:
        """The extension's name, functions and library."""
        return f"Extension({self.name!r}, functions={sorted(self.functions)}, library_path='{self.library_path}')"


def load_inline(
    name: str,
    cpp_source: str | Sequence[str] = "",
    functions: Sequence[str] = (),
    *,
    cuda_source: str | Sequence[str] | None = None,
    cuda_sources: str | Sequence[str] | None = None,
    vmap_method: str = "sequential",
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    build_directory: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Extension:
    """Compiles ``cpp_source`` (once per content), registers ``functions`` as FFI targets, returns them.

    The module's example (above) compiles, calls, jits and batches a kernel;
    it is not a doctest, as it needs a C++ compiler and seconds to compile.

    Args:
        name: the extension's name: a C identifier, used for the library's
            file name and as the prefix of its XLA target names.
        cpp_source: C++17 source defining each function with
            ``XLA_FFI_DEFINE_HANDLER_SYMBOL``; ``xla/ffi/api/ffi.h`` is
            included before it. Its handlers are registered for the CPU.
            A list of sources is joined.
        functions: the handler names to register and return.
        cuda_source: CUDA source (kernels and their FFI handlers, which
            take XLA's stream with ``.Ctx<ffi::PlatformStream<cudaStream_t>>()``),
            compiled with ``nvcc`` (``$CUDA_HOME/bin``, the ``PATH``, or the
            ``nvidia-cuda-nvcc`` wheel); its handlers are registered for
            CUDA GPUs. A function defined in both sources runs the one for
            the device of its arguments.
        cuda_sources: PyTorch's spelling of ``cuda_source``, the same.
        vmap_method: how calls batch under ``vmap`` unless a call says
            otherwise: ``"sequential"``, ``"expand_dims"`` or ``"broadcast_all"``.
        extra_cflags: more compiler arguments.
        extra_cuda_cflags: more ``nvcc`` arguments (``-arch=sm_90``, ...).
        extra_ldflags: more linker arguments.
        build_directory: where libraries are cached (see the module's tips).
        verbose: print the compiler's commands and output.

    Returns:
        An `Extension` with one `FfiKernel` per function.

    Raises:
        BuildError: no C++ compiler (or, for ``cuda_source``, no ``nvcc``)
            was found, or compiling or linking failed (the message holds
            the compiler's output).
        ValueError: ``name`` or a function name is not a C identifier, a
            function is not defined in the compiled library, or
            ``vmap_method`` is unknown.
        TypeError: ``functions`` is a string, not a list of names.
        PermissionError: the cached library, or its directory, is owned by
            another user or writable by group or others.
    """
    _check_identifier("name", name)
    if isinstance(functions, str):
        raise TypeError(f"load_inline: functions must be a list of names, not the string {functions!r}")
    functions = list(functions)
    if not functions:
        raise ValueError(
            "load_inline: functions is empty; name the handlers (XLA_FFI_DEFINE_HANDLER_SYMBOL) to register"
        )
    for function in functions:
        _check_identifier("function name", function)
    method = _checked_vmap_method(vmap_method)
    if cuda_source is not None and cuda_sources is not None:
        raise TypeError("load_inline: give cuda_source or cuda_sources (PyTorch's spelling), not both")
    cpp = _joined(cpp_source)
    cuda = _joined(cuda_source if cuda_source is not None else cuda_sources)
    if not cpp.strip() and not cuda.strip():
        raise ValueError("load_inline: no source: give cpp_source (CPU kernels), cuda_source (CUDA kernels) or both")

    api = _jax_internals.ffi_api()
    include_dir = api.include_dir()
    directory = pathlib.Path(build_directory) if build_directory is not None else default_build_directory()
    headers = _headers_digest(include_dir)
    builds: list[tuple[str, _Compiler, str]] = []  # (XLA platform, compiler, full source)
    if cpp.strip():
        builds.append(("cpu", _Compiler(extra_cflags, extra_ldflags, verbose), _SOURCE_PREFIX + cpp))
    if cuda.strip():
        builds.append(("CUDA", _CudaCompiler(extra_cuda_cflags, extra_ldflags, verbose), _CUDA_SOURCE_PREFIX + cuda))
    # One key for the extension (its target names), from both sources; one library per platform.
    key = _content_hash(name, *(part for _, compiler, source in builds for part in (source, compiler.signature())),
                        include_dir, headers)
    entry = directory / f"{name}_{key[:16]}"

    with _lock:
        found: dict[str, list[str]] = {function: [] for function in functions}
        symbols = []
        library_path = entry / f"{name}.so"
        for platform_name, compiler, source in builds:
            library_path = entry / (f"{name}.so" if platform_name == "cpu" else f"{name}_cuda.so")
            library = _load_or_build(compiler, source, library_path, include_dir)
            for function in functions:
                if hasattr(library, function):
                    found[function].append(platform_name)
                    symbols.append((function, platform_name, getattr(library, function)))
        for function, platforms in found.items():
            if not platforms:
                _symbol_missing(function, cpp + "\n" + cuda, name)
        kernels = {}
        for function, platform_name, symbol in symbols:
            # The hash in the name keeps an edited source's kernels apart. A name
            # registered before is the same kernel (the same key), maybe from a copy
            # in another directory, which XLA refuses to register at a second address.
            target_name = f"{name}_{key[:16]}.{function}"
            if (target_name, platform_name) not in _registered:
                api.register_ffi_target(target_name, api.pycapsule(symbol), platform=platform_name)
                _registered.add((target_name, platform_name))
            kernels[function] = FfiKernel(function, target_name, method, found[function])
    return Extension(name, entry / f"{name}.so" if cpp.strip() else library_path, kernels)


def _joined(source: str | Sequence[str] | None) -> str:
    """A source, or a list of sources (PyTorch's ``cpp_sources``, ``cuda_sources``), as one string."""
    if source is None:
        return ""
    return source if isinstance(source, str) else "\n".join(source)


def default_build_directory() -> pathlib.Path:
    """``$VJPKIT_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/vjpkit/cpp_extensions`` (``~/.cache`` by default)."""
    if os.environ.get("VJPKIT_EXTENSIONS_DIR"):
        return pathlib.Path(os.environ["VJPKIT_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "vjpkit" / "cpp_extensions"


# --- building ------------------------------------------------------------------------------------------------


def _load_or_build(compiler: _Compiler, source: str, library_path: pathlib.Path, include_dir: str) -> ctypes.CDLL:
    """The cached library, built first if it is missing, or again if it cannot be loaded."""
    if library_path.exists():
        _check_private(library_path)
        try:
            library = ctypes.CDLL(str(library_path))
        except OSError as error:  # an empty or truncated file (a full disk, a killed copy): build it again
            if compiler.verbose:
                print(f"load_inline: rebuilding {library_path}, which cannot be loaded: {error}", file=sys.stderr)
        else:
            if compiler.verbose:
                print(f"load_inline: using cached {library_path}", file=sys.stderr)
            return library
    compiler.build(source, library_path, include_dir=include_dir)
    _check_private(library_path)
    try:
        return ctypes.CDLL(str(library_path))
    except OSError as error:
        raise BuildError(
            f"load_inline: the library just built in the cache entry {library_path.parent} cannot be "
            f"loaded: {error}. Check that the compiler builds shared libraries for this machine "
            f"({platform.machine()}), and the flags in $CXXFLAGS, $LDFLAGS and extra_ldflags; delete "
            "the entry to try again."
        ) from None


def _check_private(library_path: pathlib.Path) -> None:
    """Refuses a cached library that another user wrote or could write: loading it runs its code here."""
    if not hasattr(os, "geteuid"):
        return  # no POSIX owners (Windows)
    me = os.geteuid()
    for path in (library_path.parent, library_path):
        info = path.stat()
        writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if info.st_uid == me and not writable:
            continue
        what = "directory" if path.is_dir() else "library"
        if info.st_uid != me:
            why = f"is owned by user id {info.st_uid}, not by you ({me})"
        else:
            who = " and ".join(w for bit, w in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if writable & bit)
            why = f"is writable by {who} (mode {stat.filemode(info.st_mode)})"
        raise PermissionError(
            f"load_inline: refusing to load the cached {what} {path}: it {why}, so another user "
            "could have put code there that would run in this process. Point VJPKIT_EXTENSIONS_DIR "
            "(or build_directory=) at a directory only you can write, or, if you trust the file, "
            f"make it yours and not writable by others (chmod go-w {path}) or delete "
            f"{library_path.parent} to build it again."
        )


class _Compiler:
    """The C++ compiler (``$CXX``, else the first on the PATH), run directly, its output captured."""

    suffix = ".cpp"

    def __init__(self, extra_cflags: Sequence[str], extra_ldflags: Sequence[str], verbose: bool):
        self.command = _compiler_command()
        environment = [shlex.split(os.environ.get(variable, "")) for variable in ("CPPFLAGS", "CXXFLAGS", "LDFLAGS")]
        self.cflags = [*_CXX_FLAGS, "-fPIC", *environment[0], *environment[1], *extra_cflags]
        self.ldflags = ["-shared", *environment[2], *extra_ldflags]
        self.verbose = verbose

    def signature(self) -> str:
        """Everything about the build besides the source and headers, for the content hash."""
        executable = shutil.which(self.command[0])
        identity: Any = None  # the compiler's file: an upgrade changes its size or time
        if executable is not None:
            info = os.stat(executable)  # through symlinks (c++ -> g++-12)
            identity = (os.path.realpath(executable), info.st_size, info.st_mtime_ns)
        return repr((self.command, identity, self.cflags, self.ldflags, sys.platform, platform.machine()))

    def build(self, source: str, library_path: pathlib.Path, *, include_dir: str) -> None:
        library_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        # Build in a private directory, then rename into place: a concurrent
        # process never sees a half-written library.
        with tempfile.TemporaryDirectory(dir=library_path.parent, prefix=".build-") as work:
            source_path = pathlib.Path(work) / f"{library_path.stem}{self.suffix}"
            source_path.write_text(source)
            built = pathlib.Path(work) / library_path.name
            self._run([
                *self.command, *self.cflags, f"-I{include_dir}", str(source_path), "-o", str(built), *self.ldflags
            ])
            os.chmod(built, 0o755)  # not group-writable, whatever the umask: _check_private accepts it
            os.replace(built, library_path)

    def _run(self, command: Sequence[str]) -> None:
        if self.verbose:
            print(shlex.join(command), file=sys.stderr)
        try:
            result = subprocess.run(list(command), capture_output=True, text=True)
        except FileNotFoundError:
            raise BuildError(self.missing(command[0])) from None
        if self.verbose and (result.stdout or result.stderr):
            print(result.stdout + result.stderr, file=sys.stderr)
        if result.returncode != 0:
            raise BuildError(
                f"load_inline: building failed (exit status {result.returncode}):\n"
                f"$ {shlex.join(command)}\n{result.stdout}{result.stderr}"
            )


    def missing(self, command: str) -> str:
        return (
            f"load_inline: no C++ compiler: {command!r} was not found. Install one "
            f"(g++ or clang++), or point the CXX environment variable at it."
        )


class _CudaCompiler(_Compiler):
    """``nvcc``: ``$CUDA_HOME/bin`` (or ``$CUDA_PATH``), else the ``PATH``, else the ``nvidia-cuda-nvcc`` wheel.

    The library links to the CUDA runtime that JAX's CUDA plugin loads; a
    kernel launched on XLA's stream (``PlatformStream<cudaStream_t>``) runs
    in order with the rest of the program.
    """

    suffix = ".cu"

    def __init__(self, extra_cuda_cflags: Sequence[str], extra_ldflags: Sequence[str], verbose: bool):
        nvcc, includes = _nvcc()
        self.command = [nvcc]
        self.cflags = ["-std=c++17", "-O2", "-Xcompiler", "-fPIC", *(f"-I{i}" for i in includes),
                       *shlex.split(os.environ.get("NVCC_FLAGS", "")), *extra_cuda_cflags]
        self.ldflags = ["-shared", *extra_ldflags]
        self.verbose = verbose

    def missing(self, command: str) -> str:
        return (
            f"load_inline: cuda_source needs nvcc, the CUDA compiler, which was not found ({command!r}): not in "
            "$CUDA_HOME/bin, on the PATH, or from the nvidia-cuda-nvcc wheel. Install the CUDA toolkit (and set "
            "CUDA_HOME), or pip install nvidia-cuda-nvcc (CUDA 13; vjpkit's cuda-build extra)."
        )


def _nvcc() -> tuple[str, list[str]]:
    """The nvcc to run, and include directories it needs besides its own (the wheels' CUDA runtime headers)."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc"), []
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path, []
    for nvidia in _nvidia_wheel_dirs():
        # pip's nvidia-cuda-nvcc: nvidia/cu13/bin/nvcc from CUDA 13 (its nvcc.profile finds the headers
        # of nvidia-cuda-runtime and nvidia-cuda-crt, and nvidia-nvvm, installed beside it).
        for nvcc in sorted(nvidia.glob("cu[0-9]*/bin/nvcc"), reverse=True):
            return str(nvcc), []
        # Older wheels' layout: nvidia/cuda_nvcc/bin/nvcc, the runtime's headers in nvidia/cuda_runtime.
        nvcc = nvidia / "cuda_nvcc" / "bin" / "nvcc"
        if nvcc.is_file():
            includes = [str(d) for d in (nvidia / "cuda_runtime" / "include", nvidia / "cuda_nvcc" / "include")
                        if d.is_dir()]
            return str(nvcc), includes
    return "nvcc", []  # building says that none was found


def _nvidia_wheel_dirs() -> list[pathlib.Path]:
    """The ``nvidia`` namespace package's directories (where NVIDIA's pip wheels install), if any."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    return [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def _compiler_command() -> list[str]:
    """``$CXX`` (split as a shell would: ``ccache g++`` works), else the first C++ compiler on the PATH."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    for name in _COMPILERS:
        if shutil.which(name):
            return [name]
    return [_COMPILERS[0]]  # building says that none was found


def _headers_digest(include_dir: str) -> str:
    """The FFI headers' content: a library is built against one version of them."""
    digest = hashlib.sha256()
    headers = pathlib.Path(include_dir) / "xla" / "ffi" / "api"
    for header in sorted(headers.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()


def _content_hash(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in (*parts, _jax_internals.JAX_RELEASE):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _symbol_missing(function: str, source: str, name: str) -> None:
    defined = _HANDLER_SYMBOL.findall(source)
    raise ValueError(
        f"load_inline({name!r}): function {function!r} is not defined in the compiled source; "
        f"the source defines {defined} with XLA_FFI_DEFINE_HANDLER_SYMBOL"
    )


def _check_identifier(what: str, value: Any) -> None:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ValueError(f"load_inline: {what} must be a C identifier (letters, digits, _), got {value!r}")


def _checked_vmap_method(vmap_method: str) -> str:
    if vmap_method not in VMAP_METHODS:
        raise ValueError(f"vmap_method must be one of {list(VMAP_METHODS)}, got {vmap_method!r}")
    return vmap_method


def _shape_dtypes(result_shape_dtypes: Any) -> Any:
    if isinstance(result_shape_dtypes, (list, tuple)):
        return [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in result_shape_dtypes]
    return jax.ShapeDtypeStruct(result_shape_dtypes.shape, result_shape_dtypes.dtype)
