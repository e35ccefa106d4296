"""C++ kernels for JAX, compiled from a source string: ``load_inline``.

Usage::

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

This is PyTorch's ``torch.utils.cpp_extension.load_inline`` for XLA's FFI:
the source is compiled once into a shared library, cached by a hash of its
content, each handler named in ``functions`` is registered as an XLA FFI
target for the CPU, and the returned :class:`Extension` has one callable
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
_CXX_FLAGS = ("-std=c++17", "-O2")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HANDLER_SYMBOL = re.compile(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)")
_COMPILERS = ("c++", "g++", "clang++")  # tried in this order when $CXX is not set

# One build at a time in this process (other processes: see _Compiler.build).
_lock = threading.Lock()
_registered: set[str] = set()  # the XLA FFI targets registered in this process


class BuildError(RuntimeError):
    """The C++ source could not be built: no compiler, or the compiler failed (its output is in the message)."""


class FfiKernel:
    """One FFI handler of an :class:`Extension`, registered as an XLA target for the CPU.

    Call it with the kernel's buffers as positional arguments and its
    attributes as keyword arguments::

        y = ext.Scale(x, result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype), factor=np.float32(3.0))

    Returns one array, or a list of arrays when ``result_shape_dtypes`` is a
    sequence.
    """

    def __init__(self, name: str, target_name: str, vmap_method: str):
        self.name = name
        self.target_name = target_name
        self.vmap_method = vmap_method

    def __call__(
        self, *args: Any, result_shape_dtypes: Any, vmap_method: str | None = None, **attributes: Any
    ) -> Any:
        method = self.vmap_method if vmap_method is None else _checked_vmap_method(vmap_method)
        call = _jax_internals.ffi_api().ffi_call(self.target_name, _shape_dtypes(result_shape_dtypes), method)
        return call(*args, **attributes)

    def __repr__(self) -> str:
        return f"FfiKernel({self.name!r}, target_name={self.target_name!r}, vmap_method={self.vmap_method!r})"


class Extension:
    """A compiled C++ source: one :class:`FfiKernel` attribute per name in ``functions``."""

    def __init__(self, name: str, library_path: pathlib.Path, kernels: dict[str, FfiKernel]):
        self.name = name
        self.library_path = library_path
        self.functions = dict(kernels)

    def __getattr__(self, attribute: str) -> FfiKernel:
        functions = self.__dict__.get("functions", {})
        if attribute in functions:
            return functions[attribute]
        raise AttributeError(
            f"extension {self.__dict__.get('name')!r} has no function {attribute!r}; "
            f"its functions are {sorted(functions)} (add a name to load_inline's functions= to register it)"
        )

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.functions})

    def __repr__(self) -> str:
        return f"Extension({self.name!r}, functions={sorted(self.functions)}, library_path='{self.library_path}')"


def load_inline(
    name: str,
    cpp_source: str,
    functions: Sequence[str],
    *,
    vmap_method: str = "sequential",
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    build_directory: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Extension:
    """Compiles ``cpp_source`` (once per content), registers ``functions`` as FFI targets, returns them.

    Args:
        name: the extension's name: a C identifier, used for the library's
            file name and as the prefix of its XLA target names.
        cpp_source: C++17 source defining each function with
            ``XLA_FFI_DEFINE_HANDLER_SYMBOL``; ``xla/ffi/api/ffi.h`` is
            included before it.
        functions: the handler names to register and return.
        vmap_method: how calls batch under ``vmap`` unless a call says
            otherwise: ``"sequential"``, ``"expand_dims"`` or ``"broadcast_all"``.
        extra_cflags: more compiler arguments.
        extra_ldflags: more linker arguments.
        build_directory: where libraries are cached (see the module's tips).
        verbose: print the compiler's commands and output.

    Returns:
        An :class:`Extension` with one :class:`FfiKernel` per function.

    Raises:
        BuildError: no C++ compiler was found, or compiling or linking
            failed (the message holds the compiler's output).
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

    api = _jax_internals.ffi_api()
    include_dir = api.include_dir()
    compiler = _Compiler(extra_cflags, extra_ldflags, verbose)
    source = _SOURCE_PREFIX + cpp_source
    digest = _content_hash(name, source, compiler.signature(), include_dir, _headers_digest(include_dir))
    directory = pathlib.Path(build_directory) if build_directory is not None else default_build_directory()
    library_path = directory / f"{name}_{digest[:16]}" / f"{name}.so"

    with _lock:
        library = _load_or_build(compiler, source, library_path, include_dir)
        kernels = {}
        for function in functions:
            # The hash in the name keeps an edited source's kernels apart. A name
            # registered before is the same kernel (the same key), maybe from a copy
            # in another directory, which XLA refuses to register at a second address.
            target_name = f"{name}_{digest[:16]}.{function}"
            symbol = _symbol(library, function, cpp_source, name)
            if target_name not in _registered:
                api.register_ffi_target(target_name, api.pycapsule(symbol), platform="cpu")
                _registered.add(target_name)
            kernels[function] = FfiKernel(function, target_name, method)
    return Extension(name, library_path, kernels)


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
            source_path = pathlib.Path(work) / f"{library_path.stem}.cpp"
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
            raise BuildError(
                f"load_inline: no C++ compiler: {command[0]!r} was not found. Install one "
                f"(g++ or clang++), or point the CXX environment variable at it."
            ) from None
        if self.verbose and (result.stdout or result.stderr):
            print(result.stdout + result.stderr, file=sys.stderr)
        if result.returncode != 0:
            raise BuildError(
                f"load_inline: building failed (exit status {result.returncode}):\n"
                f"$ {shlex.join(command)}\n{result.stdout}{result.stderr}"
            )


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


def _symbol(library: ctypes.CDLL, function: str, cpp_source: str, name: str) -> Any:
    try:
        return getattr(library, function)
    except AttributeError:
        defined = _HANDLER_SYMBOL.findall(cpp_source)
        raise ValueError(
            f"load_inline({name!r}): function {function!r} is not defined in the compiled source; "
            f"the source defines {defined} with XLA_FFI_DEFINE_HANDLER_SYMBOL"
        ) from None


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
