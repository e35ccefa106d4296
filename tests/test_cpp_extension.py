"""``vjpkit.cpp_extension.load_inline``: C++ FFI handlers compiled from a string, cached, callable from JAX.

One small source is compiled once for the module (a few seconds: the FFI
headers are large); the tests that need no new build reuse it. Expected
values are written out or computed with NumPy.
"""

import ctypes
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vjpkit import cpp_extension

SOURCE = r"""
namespace ffi = xla::ffi;

// y = factor * x
ffi::Error ScaleImpl(float factor, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = factor * x.typed_data()[i];
  return ffi::Error::Success();
}

// (x + y, x * y), elementwise
ffi::Error SumAndProductImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                             ffi::ResultBuffer<ffi::F32> sum, ffi::ResultBuffer<ffi::F32> product) {
  for (size_t i = 0; i < x.element_count(); ++i) {
    sum->typed_data()[i] = x.typed_data()[i] + y.typed_data()[i];
    product->typed_data()[i] = x.typed_data()[i] * y.typed_data()[i];
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Scale, ScaleImpl,
    ffi::Ffi::Bind().Attr<float>("factor").Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SumAndProduct, SumAndProductImpl,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                    .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def load(build_directory, functions=("Scale",), source=SOURCE, **options):
    """The test extension, cached in ``build_directory``."""
    return cpp_extension.load_inline(
        "kernels_under_test", source, list(functions), build_directory=build_directory, **options
    )


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The kernels are registered for the CPU: where JAX's default device is a GPU, the tests run on the CPU device."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def build_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("cpp_extensions")


@pytest.fixture(scope="module")
def ext(build_directory):
    return load(build_directory, ["Scale", "SumAndProduct"])


def failing_compiler(monkeypatch, message):
    """Puts a stand-in compiler in subprocess.run that fails with ``message``; the list of the commands it gets."""
    commands = []

    def compiler(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr=message)

    monkeypatch.setattr(subprocess, "run", compiler)
    return commands


def like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def test_kernel_computes_with_its_attribute(ext):
    x = jnp.array([1.0, -2.0, 0.5], jnp.float32)
    np.testing.assert_array_equal(ext.Scale(x, result_shape_dtypes=like(x), factor=np.float32(3.0)), [3.0, -6.0, 1.5])


def test_kernel_with_two_outputs_returns_both(ext):
    x, y = jnp.array([1.0, 2.0], jnp.float32), jnp.array([3.0, 4.0], jnp.float32)
    total, product = ext.SumAndProduct(x, y, result_shape_dtypes=[like(x), like(x)])
    np.testing.assert_array_equal(total, [4.0, 6.0])
    np.testing.assert_array_equal(product, [3.0, 8.0])


def test_an_array_describes_the_result_shape_and_dtype(ext):
    x = jnp.ones((2, 3), jnp.float32)
    np.testing.assert_array_equal(ext.Scale(x, result_shape_dtypes=x, factor=np.float32(2.0)), np.full((2, 3), 2.0))


def test_kernel_runs_under_jit(ext):
    scale = jax.jit(lambda x: ext.Scale(x, result_shape_dtypes=x, factor=np.float32(-1.0)))
    np.testing.assert_array_equal(scale(jnp.arange(4.0, dtype=jnp.float32)), [0.0, -1.0, -2.0, -3.0])


@pytest.mark.parametrize("vmap_method", ["sequential", "expand_dims", "broadcast_all"])
def test_kernel_batches_under_vmap_with_each_method(ext, vmap_method):
    rows = jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2)
    scaled = jax.vmap(lambda r: ext.Scale(r, result_shape_dtypes=r, vmap_method=vmap_method, factor=np.float32(2.0)))
    np.testing.assert_array_equal(scaled(rows), 2.0 * np.arange(6.0).reshape(3, 2))


def test_extension_vmap_method_is_the_default_for_its_calls(ext, build_directory):
    again = load(build_directory, vmap_method="broadcast_all")
    assert again.Scale.vmap_method == "broadcast_all"
    assert ext.Scale.vmap_method == "sequential"


def test_same_source_loads_the_cached_library_without_compiling(ext, build_directory, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise AssertionError(f"the compiler ran: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = load(build_directory)
    assert again.library_path == ext.library_path
    x = jnp.ones(2, jnp.float32)
    np.testing.assert_array_equal(again.Scale(x, result_shape_dtypes=x, factor=np.float32(5.0)), [5.0, 5.0])


def test_changed_source_is_built_again(ext, build_directory, monkeypatch):
    commands = failing_compiler(monkeypatch, "stand-in compiler\n")
    with pytest.raises(cpp_extension.BuildError, match="stand-in compiler"):
        load(build_directory, source=SOURCE + "// edited\n")
    assert len(commands) == 1
    assert not any(build_directory.glob("*/.build-*")), "the failed build's working directory was left behind"


def test_libraries_are_cached_under_VJPKIT_EXTENSIONS_DIR(monkeypatch, tmp_path):
    monkeypatch.setenv("VJPKIT_EXTENSIONS_DIR", str(tmp_path))
    assert cpp_extension.default_build_directory() == tmp_path


def test_libraries_are_cached_under_XDG_CACHE_HOME_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("VJPKIT_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpp_extension.default_build_directory() == tmp_path / "vjpkit" / "cpp_extensions"


def test_missing_compiler_raises_build_error_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpp_extension.BuildError, match=r"no C\+\+ compiler: '/nonexistent/c(c|\+\+)' was not found"):
        cpp_extension.load_inline("no_compiler", SOURCE, ["Scale"], build_directory=tmp_path)


def test_compile_error_raises_build_error_with_the_compilers_output(tmp_path):
    broken = "\nint Broken() { return undefined_name; }\n"
    with pytest.raises(cpp_extension.BuildError, match="(?s)building failed.*<cpp_source>:2.*undefined_name") as info:
        cpp_extension.load_inline("broken", broken, ["Broken"], build_directory=tmp_path)
    assert "-std=c++17" in str(info.value), "the failing command is part of the message"


def test_unknown_function_raises_value_error_listing_the_defined_handlers(ext, build_directory):
    with pytest.raises(ValueError, match=r"function 'Scal' is not defined.*\['Scale', 'SumAndProduct'\]"):
        load(build_directory, ["Scal"])


def test_function_not_loaded_raises_attribute_error_naming_the_loaded_ones(build_directory):
    ext = load(build_directory)
    with pytest.raises(AttributeError, match=r"has no function 'SumAndProduct'; its functions are \['Scale'\]"):
        ext.SumAndProduct  # noqa: B018


def test_functions_given_as_one_string_raises_type_error(build_directory):
    with pytest.raises(TypeError, match="functions must be a list of names, not the string 'Scale'"):
        cpp_extension.load_inline("kernels_under_test", SOURCE, "Scale", build_directory=build_directory)


def test_no_functions_raises_value_error(build_directory):
    with pytest.raises(ValueError, match="functions is empty"):
        load(build_directory, [])


@pytest.mark.parametrize("name", ["two words", "3d", "a-b", ""])
def test_name_that_is_not_an_identifier_raises_value_error(name, build_directory):
    with pytest.raises(ValueError, match="name must be a C identifier"):
        cpp_extension.load_inline(name, SOURCE, ["Scale"], build_directory=build_directory)


def test_unknown_vmap_method_raises_value_error(ext, build_directory):
    methods = r"\['sequential', 'expand_dims', 'broadcast_all'\]"
    with pytest.raises(ValueError, match=f"vmap_method must be one of {methods}, got 'loop'"):
        load(build_directory, vmap_method="loop")
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(ValueError, match="vmap_method must be one of"):
        ext.Scale(x, result_shape_dtypes=x, vmap_method="vectorized", factor=np.float32(1.0))


def test_building_runs_the_compiler_without_setuptools(monkeypatch, tmp_path):
    commands = []

    def compiler(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr="stand-in compiler\n")

    monkeypatch.setitem(sys.modules, "setuptools", None)  # importing it raises ImportError
    monkeypatch.setitem(sys.modules, "distutils", None)
    monkeypatch.setenv("CXX", "ccache my-c++")
    monkeypatch.setattr(subprocess, "run", compiler)
    with pytest.raises(cpp_extension.BuildError, match="stand-in compiler"):
        cpp_extension.load_inline("no_setuptools", SOURCE, ["Scale"], build_directory=tmp_path)
    (command,) = commands
    assert command[:2] == ["ccache", "my-c++"]
    assert {"-std=c++17", "-fPIC", "-shared"} <= set(command)


def test_importing_vjpkit_imports_no_setuptools():
    code = "import sys, vjpkit; print(sorted(m for m in sys.modules if m.split('.')[0] in ('setuptools', 'distutils')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.thorough  # a real build; the unloadable-library test below makes the point with a stand-in compiler
def test_corrupt_cached_library_is_built_again(ext, build_directory, tmp_path):
    # The same cache entry in a fresh directory (a path this process never loaded), holding an empty file.
    corrupt = tmp_path / ext.library_path.relative_to(build_directory)
    corrupt.parent.mkdir(mode=0o755)
    corrupt.write_bytes(b"")
    again = load(tmp_path, ["Scale", "SumAndProduct"])
    assert again.library_path == corrupt
    assert ctypes.CDLL(str(corrupt)).Scale  # a library again, defining the kernel
    x = jnp.ones(2, jnp.float32)
    np.testing.assert_array_equal(again.Scale(x, result_shape_dtypes=x, factor=np.float32(4.0)), [4.0, 4.0])


def test_library_that_cannot_be_loaded_after_building_raises_build_error_naming_the_entry(monkeypatch, tmp_path):
    def empty_library_compiler(command, **kwargs):
        pathlib.Path(command[command.index("-o") + 1]).write_bytes(b"")  # "succeeds", with an unloadable library
        return subprocess.CompletedProcess(command, returncode=0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", empty_library_compiler)
    with pytest.raises(cpp_extension.BuildError, match=r"the library just built in the cache entry (\S+) cannot be "
                                                        r"loaded: .*delete the entry to try again") as info:
        cpp_extension.load_inline("unloadable", SOURCE, ["Scale"], build_directory=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert info.match(re.escape(str(entry)))
    # A second load finds the entry unloadable and builds it again, with the same result.
    with pytest.raises(cpp_extension.BuildError, match="the library just built"):
        cpp_extension.load_inline("unloadable", SOURCE, ["Scale"], build_directory=tmp_path)


def test_cache_key_holds_the_cpu_architecture(monkeypatch, tmp_path):
    failing_compiler(monkeypatch, "not built\n")
    entries = set()
    for machine in ("x86_64", "aarch64"):
        monkeypatch.setattr(platform, "machine", lambda machine=machine: machine)
        with pytest.raises(cpp_extension.BuildError, match=r"(?s)-o (\S+)/arch\.so"):
            cpp_extension.load_inline("arch", SOURCE, ["Scale"], build_directory=tmp_path)
    entries = {p.name for p in tmp_path.iterdir()}
    assert len(entries) == 2, entries


@pytest.mark.parametrize("variable", ["CXXFLAGS", "CPPFLAGS", "LDFLAGS"])
def test_cache_key_holds_the_compiler_flags_from_the_environment(monkeypatch, tmp_path, variable):
    commands = failing_compiler(monkeypatch, "not built\n")
    for value in ("", "-DVARIANT=1"):
        monkeypatch.setenv(variable, value)
        with pytest.raises(cpp_extension.BuildError):
            cpp_extension.load_inline("flags", SOURCE, ["Scale"], build_directory=tmp_path)
    assert "-DVARIANT=1" in commands[1] and "-DVARIANT=1" not in commands[0]
    assert len(set(tmp_path.iterdir())) == 2


def _copy_of_the_cached_library(ext, build_directory, tmp_path):
    """The module's library, copied into the same cache entry of a fresh directory."""
    copy = tmp_path / ext.library_path.relative_to(build_directory)
    copy.parent.mkdir(mode=0o755)
    shutil.copy(ext.library_path, copy)
    os.chmod(copy, 0o755)
    return copy


@pytest.mark.parametrize("mode", [0o775, 0o757], ids=["group", "others"])
def test_cached_library_writable_by_others_is_refused(ext, build_directory, tmp_path, monkeypatch, mode):
    copy = _copy_of_the_cached_library(ext, build_directory, tmp_path)
    os.chmod(copy, mode)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the compiler ran"))
    who = "group" if mode & 0o020 else "others"
    with pytest.raises(PermissionError, match=re.escape(f"refusing to load the cached library {copy}: it is writable "
                                                        f"by {who}") + ".*chmod go-w"):
        load(tmp_path)


def test_cached_library_in_a_group_writable_directory_is_refused(ext, build_directory, tmp_path):
    copy = _copy_of_the_cached_library(ext, build_directory, tmp_path)
    os.chmod(copy.parent, 0o775)
    with pytest.raises(PermissionError, match=re.escape(f"refusing to load the cached directory {copy.parent}: it "
                                                        "is writable by group (mode drwxrwxr-x)")):
        load(tmp_path)


def test_cached_library_of_another_user_is_refused(ext, build_directory, tmp_path, monkeypatch):
    copy = _copy_of_the_cached_library(ext, build_directory, tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: copy.stat().st_uid + 1)
    with pytest.raises(PermissionError, match=r"refusing to load the cached directory .* it is owned by user id \d+, "
                                              r"not by you .*Point VJPKIT_EXTENSIONS_DIR"):
        load(tmp_path)


def test_a_build_is_not_group_writable_whatever_the_umask(monkeypatch, tmp_path):
    def compiler(command, **kwargs):
        output = pathlib.Path(command[command.index("-o") + 1])
        output.write_bytes(b"")
        os.chmod(output, 0o777)
        return subprocess.CompletedProcess(command, returncode=0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", compiler)
    previous = os.umask(0o002)
    try:
        with pytest.raises(cpp_extension.BuildError, match="cannot be loaded"):  # an empty library, but not refused
            cpp_extension.load_inline("umask", SOURCE, ["Scale"], build_directory=tmp_path)
    finally:
        os.umask(previous)
    (library,) = tmp_path.glob("*/umask.so")
    assert library.stat().st_mode & 0o022 == 0
    assert library.parent.stat().st_mode & 0o022 == 0


def test_the_same_library_in_two_directories_loads_in_one_process(ext, build_directory, tmp_path, monkeypatch):
    copy = _copy_of_the_cached_library(ext, build_directory, tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the compiler ran"))
    again = load(tmp_path)
    assert again.library_path == copy
    x = jnp.ones(2, jnp.float32)
    np.testing.assert_array_equal(again.Scale(x, result_shape_dtypes=x, factor=np.float32(2.0)), [2.0, 2.0])


# -- CUDA sources ----------------------------------------------------------------------------------------------

CUDA_SOURCE = r"""
namespace ffi = xla::ffi;

__global__ void ScaleKernel(float factor, const float* x, float* y, size_t n) {
  size_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = factor * x[i];
}

// y = factor * x, on XLA's stream
ffi::Error ScaleImpl(cudaStream_t stream, float factor, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  size_t n = x.element_count();
  ScaleKernel<<<(n + 255) / 256, 256, 0, stream>>>(factor, x.typed_data(), y->typed_data(), n);
  cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(error));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Scale, ScaleImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Attr<float>("factor")
                    .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
"""


@pytest.mark.slow  # nvcc takes tens of seconds; CI installs it (the cuda-build extra), so this runs there
def test_cuda_source_is_compiled_with_nvcc_and_registered_for_cuda_beside_the_cpu_kernel(build_directory):
    if cpp_extension._nvcc()[0] == "nvcc" and shutil.which("nvcc") is None:
        pytest.skip("no nvcc: neither the CUDA toolkit nor the nvidia-cuda-nvcc wheel (the cuda-build extra)")
    ext = cpp_extension.load_inline("cuda_under_test", SOURCE, ["Scale", "SumAndProduct"], cuda_source=CUDA_SOURCE,
                                    build_directory=build_directory)
    assert ext.Scale.platforms == ("cpu", "CUDA")
    assert ext.SumAndProduct.platforms == ("cpu",)
    assert (ext.library_path.parent / "cuda_under_test_cuda.so").is_file()
    # Here (no GPU) the C++ kernel of the same name runs.
    y = ext.Scale(jnp.arange(3.0), result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32), factor=np.float32(2))
    np.testing.assert_array_equal(y, [0.0, 2.0, 4.0])


def test_a_kernel_called_on_a_device_it_was_not_compiled_for_raises_naming_both():
    cuda_only = cpp_extension.FfiKernel("Scale", "never_registered.Scale", "sequential", ["CUDA"])
    with pytest.raises(ValueError, match=re.escape(
        "Scale is compiled for gpu only (from load_inline's cuda_source), but an argument is on cpu. Put the "
        "arguments on a gpu device")):
        cuda_only(jnp.ones(3), result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32), factor=np.float32(2))


def test_cuda_source_without_nvcc_raises_build_error_naming_it(monkeypatch, tmp_path):
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc on it
    monkeypatch.setattr(cpp_extension, "_nvidia_wheel_dirs", lambda: [])
    with pytest.raises(cpp_extension.BuildError, match=r"load_inline: cuda_source needs nvcc, the CUDA compiler, "
                                                       r"which was not found \('nvcc'\)"):
        cpp_extension.load_inline("no_nvcc", "", ["Scale"], cuda_source=CUDA_SOURCE, build_directory=tmp_path)


def test_cuda_source_and_cuda_sources_together_raise_type_error(build_directory):
    with pytest.raises(TypeError, match="give cuda_source or cuda_sources"):
        cpp_extension.load_inline("both", "", ["Scale"], cuda_source=CUDA_SOURCE, cuda_sources=[CUDA_SOURCE],
                                  build_directory=build_directory)


def test_no_source_at_all_raises_value_error(build_directory):
    with pytest.raises(ValueError, match="load_inline: no source: give cpp_source"):
        cpp_extension.load_inline("empty", "", ["Scale"], build_directory=build_directory)


def test_pytorch_spelling_cuda_sources_is_the_list_joined(monkeypatch, tmp_path):
    built = []  # the sources handed to the build, which builds nothing here
    monkeypatch.setattr(cpp_extension, "_load_or_build",
                        lambda compiler, source, path, include_dir: built.append(source) or types.SimpleNamespace())
    with pytest.raises(ValueError, match="function 'Scale' is not defined"):
        cpp_extension.load_inline("split", "", ["Scale"], cuda_sources=["// part one", "// part two"],
                                  build_directory=tmp_path)
    assert built[0].endswith("// part one\n// part two")
