"""XLA flag presets, checked against the installed jaxlib and set before a backend starts.

XLA flags (cfg.xla) go into the XLA_FLAGS environment variable, which XLA reads once, when JAX
starts its first backend: `apply` must run before that, and checks every flag against
the installed jaxlib first, since XLA kills the process on a flag it does not know.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

from jaxtron.config import ConfigError, XlaConfig

# jax's GPU allocator reads its share of the device's memory from the first of these that is set
MEM_FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")

# Names and values follow the JAX GPU performance tips and NVIDIA JAX-Toolbox's
# GPU_performance.md, the flags MaxText's GPU recipes set; tests/test_xla_flags.py checks that the
# installed jaxlib knows every one.
XLA_PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "gpu": (
        # Schedule each async collective's start early and its wait late, so communication runs
        # under independent compute; without it the flags below have little to overlap with.
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        # Put the collectives' stream at the highest CUDA priority, so a queue of compute kernels
        # does not delay the transfers that the next layer waits for.
        "--xla_gpu_enable_highest_priority_async_stream=true",
        # FSDP over the scanned layers: move the next layer's weight all-gather, and this layer's
        # gradient reduce-scatter / all-reduce, into the neighbouring loop iteration, where they
        # overlap that iteration's matmuls.
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        # Unroll the layer loop by two with alternating buffers, so the pipelined collectives of
        # one iteration can fill the other's buffer without a copy.
        "--xla_gpu_enable_while_loop_double_buffering=true",
        # Combine small collectives into one of up to 128 MiB (XLA's default is 30 MiB): a
        # scanned layer's many small weight gathers and gradient reductions become a few NCCL
        # calls that reach full bandwidth, while each combined buffer stays small next to an
        # 80 GB GPU and the latency-hiding scheduler still has several of them to overlap.
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        # Let the combiners merge gathers / reductions over different dimensions, not only over
        # the same one: FSDP splits W_q[D_fsdp, N, H] on its first dimension, W_o[N, H, D_fsdp]
        # on its last, so a layer's weights could otherwise not share one collective.
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        # XLA's own rematerialization recomputes fusions, matmuls included, whenever its memory
        # measure passes slop% of the device's memory less the arguments. That measure runs
        # above the compiled peak (gpt2_124m as shipped: 71.8 GiB measured, 54.7 compiled), so at
        # XLA's default (95) it fired on presets that fit: matmuls 1.03x (gpt2_124m) and 1.01x
        # (llama3_1b) what their remat policy implies, and llama3_70b's schedule left 124.5 GiB
        # of fsdp traffic per step exposed instead of 84.5. At 130 it recomputes no preset's
        # matmuls, and 200 or more changes none of them further. The remat policy and
        # microbatches are what keeps memory in bounds (model.remat=auto: jaxtron/plan/autofit.py,
        # which also compiles a program its estimate says does not fit with no limit at all).
        "--xla_gpu_memory_limit_slop_factor=130",
    ),
}
# Modules of a CUDA build of jax (pip install 'jax[cuda12]' or 'jax[cuda13]'): its PJRT plugin and
# its kernel plugin. Finding them imports neither, and starts no backend.
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin",
                "jax_cuda12_plugin")
_XLA_FLAG = re.compile(r"^--([A-Za-z][A-Za-z0-9_]*)(=\S*)?$")  # --name or --name=value


def resolve_preset(preset: str) -> str:
    """`auto` -> `gpu` if a CUDA jax is installed and JAX_PLATFORMS allows it, else `none`."""
    if preset != "auto":
        if preset not in XLA_PRESETS:
            raise ConfigError(f"xla.preset={preset} is not one of auto, {', '.join(XLA_PRESETS)}")
        return preset
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.replace(" ", "").split(",")):
        return "none"  # e.g. JAX_PLATFORMS=cpu on a GPU machine: no GPU backend to tune
    return "gpu" if any(map(_installed, CUDA_PLUGINS)) else "none"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (jax_plugins) is not there either
        return False


def _merge(cfg_xla: XlaConfig, env_flags: str) -> dict[str, tuple[str, str]]:
    """Flag name -> (flag, where it came from): XLA_FLAGS, preset, xla.flags, a later flag
    replacing an earlier one of the same name."""
    preset = resolve_preset(cfg_xla.preset)
    sources = [("XLA_FLAGS", env_flags.split()), (f"xla.preset={preset}", XLA_PRESETS[preset]),
               ("xla.flags", cfg_xla.flags)]
    merged: dict[str, tuple[str, str]] = {}
    for source, flags in sources:
        for flag in map(str, flags):
            name = _flag_name(flag, source)
            merged.pop(name, None)  # the later one wins, and moves to the end
            merged[name] = (flag, source)
    return merged


def _flag_name(flag: str, source: str) -> str:
    """`name` of --name or --name=value; anything else is a ConfigError."""
    match = _XLA_FLAG.match(flag)
    if match is None:
        raise ConfigError(f"'{flag}' (in {source}) is not an XLA flag: write --name or "
                          "--name=value, one flag per list item, e.g. --xla_dump_to=/tmp/hlo")
    return match.group(1)


def for_config(cfg_xla: XlaConfig, env_flags: str = "") -> list[str]:
    """The XLA flags in effect: `env_flags` (XLA_FLAGS), preset, xla.flags."""
    return [flag for flag, _ in _merge(cfg_xla, env_flags).values()]


def check(flags: list[str], sources: dict[str, str] | None = None) -> None:
    """Raise a ConfigError naming the flags the installed jaxlib rejects (unknown name, bad value).

    XLA reads XLA_FLAGS when a backend starts and ends the process on a bad flag, so a short child
    process starts jaxlib's CPU client with `flags` (~0.3 s) and its message is read back here.
    """
    by_name = {_flag_name(flag, "xla flags"): flag for flag in flags}
    code = "from jaxlib import xla_client; xla_client.make_cpu_client()"
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    if proc.returncode == 0:
        return
    jaxlib = f"jaxlib {_version('jaxlib')}"

    def where(name: str) -> str:
        flag = by_name.get(name, f"--{name}")
        return f"{flag} (from {(sources or {}).get(name, 'XLA_FLAGS')})"

    if unknown := re.search(r"Unknown flags? in XLA_FLAGS: (.*)", proc.stderr):
        known = [_flag_name(f, "") for f in XLA_PRESETS["gpu"]]
        described = []
        for name in re.findall(r"--([A-Za-z0-9_]+)", unknown.group(1)):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            described.append(where(name) + (f", did you mean --{close[0]}?" if close else ""))
        raise ConfigError(f"{jaxlib} has no XLA flag{'s' if len(described) > 1 else ''} "
                          + "; ".join(described))
    if bad := re.search(r"(?:value .* for flag |Illegal value for --)([A-Za-z0-9_]+)", proc.stderr):
        raise ConfigError(f"{jaxlib} cannot read the value of XLA flag {where(bad.group(1))}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    raise ConfigError(f"{jaxlib} rejected XLA_FLAGS={' '.join(flags)}: "
                      f"{lines[-1] if lines else f'exit status {proc.returncode}'}")


def mem_fraction(name: str, value: str) -> float:
    """A memory-fraction variable's value: a number in (0, 1], as xla.mem_fraction must be."""
    try:
        fraction = float(value)
    except ValueError:
        fraction = float("nan")
    if not 0 < fraction <= 1:  # NaN fails this too
        raise ConfigError(f"{name}={value} must be a share of each GPU's memory in (0, 1], as "
                          f"xla.mem_fraction must; set e.g. {name}=0.9, or unset {name} and "
                          "set xla.mem_fraction")
    return fraction


def env_mem_fraction(environ=os.environ) -> tuple[str, float] | None:
    """(name, value) of the first MEM_FRACTION_VARS set, checked by `mem_fraction`; or None."""
    name = next((n for n in MEM_FRACTION_VARS if environ.get(n)), "")
    return (name, mem_fraction(name, environ[name])) if name else None


def start_backend() -> list:
    """jax.devices(), starting jax's backend (after `apply` and jax.distributed): a backend that
    cannot start here is a ConfigError naming JAX_PLATFORMS, not jax's traceback."""
    import jax

    try:
        return jax.devices()
    except (RuntimeError, AssertionError) as e:  # AssertionError: cuda asked for, no GPU seen
        raise ConfigError(_no_backend(str(e))) from None


def _no_backend(error: str) -> str:
    """What to change when jax's backend did not start with `error` (jax's message)."""
    cause = re.sub(r"\s*\((set JAX_PLATFORMS|you may need)[^)]*\)\.?$", "", error.strip())
    cause = re.sub(r"^Unable to initialize backend '[^']*': ", "", cause.split("\n")[0])
    cause = cause.rstrip(".") if len(cause) <= 160 else cause[:157] + "..."
    name = os.environ.get("JAX_PLATFORM_NAME", "").strip()
    if name and re.search(rf"backend:? '?{re.escape(name)}\b", error):  # asked for by jax's old
        # variable (JAX_PLATFORMS unset, or set to backends that do not include it)
        return (f"JAX_PLATFORM_NAME={name}, but no {name} backend starts here ({cause}); unset "
                "JAX_PLATFORM_NAME (jax's old name for JAX_PLATFORMS; jax then picks what it "
                "finds)")
    # JAX_PLATFORMS=cpu set by load_plugins_quietly, not by the user, is not theirs to change
    platforms = "" if _PLATFORMS_SET_HERE else os.environ.get("JAX_PLATFORMS", "").strip()
    if not platforms:
        return (f"jax could not start a backend ({cause or 'no device found'}); set "
                "JAX_PLATFORMS=cpu to skip a failing plugin, or reinstall: pip install -e .")
    cause = cause or "no NVIDIA GPU visible"  # jax skips cuda without one, and then has nothing
    fix = ("pip install -e '.[cuda12]' on a GPU machine, or unset JAX_PLATFORMS"
           if {"cuda", "gpu"} & set(platforms.replace(" ", "").split(",")) else
           "unset JAX_PLATFORMS (jax then picks what it finds), or set JAX_PLATFORMS=cpu")
    return f"JAX_PLATFORMS={platforms}, but no {platforms} backend starts here ({cause}); {fix}"


_PLATFORMS_SET_HERE = False  # whether load_plugins_quietly set JAX_PLATFORMS (the user did not)


def load_plugins_quietly() -> None:
    """Import jax and load its PJRT plugins now, with stderr silenced on a machine that has the
    CUDA plugin but no NVIDIA driver.

    There the plugin (the gpu-aot extra, for --compile-for) logs "Could not find cuda drivers on
    your machine" through absl, straight to file descriptor 2, once per CUDA kernel module that
    `import jax` loads and again when jax registers the plugin: six lines above every command's
    own output. Loading registers plugins only: no backend starts, and XLA_FLAGS set afterwards
    still apply. With a driver present, or without the plugin, this does nothing.
    """
    if os.path.exists("/proc/driver/nvidia") or not any(map(_installed, CUDA_PLUGINS)):
        return
    # No GPU can start here; saying so lets the plugin register for compile-only use (with
    # platforms unset it checks the CUDA runtime, fails, and stays unregistered).
    global _PLATFORMS_SET_HERE
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        _PLATFORMS_SET_HERE = True
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            from jax._src import xla_bridge

            discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
            if discover is not None:  # another jax version: it loads its plugins itself
                discover()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def apply(cfg_xla: XlaConfig) -> list[str]:
    """Merge, check and export XLA_FLAGS for the backend JAX will start; return the flags in effect.

    Call before anything starts a jax backend (jax.devices(), the first computation): XLA reads
    the variable once, then ignores it.
    """
    env_flags = os.environ.get("XLA_FLAGS", "")
    env_mem_fraction()  # a bad one, like a bad xla.mem_fraction, stops here in one line
    merged = _merge(cfg_xla, env_flags)
    flags = [flag for flag, _ in merged.values()]
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is not None and xla_bridge.backends_are_initialized():
        running = for_config(XlaConfig(preset="none"), env_flags)
        if set(flags) == set(running):
            return flags  # nothing to add: the running backend started with these
        ignored = " ".join(flag for flag in flags if flag not in running)
        raise RuntimeError(f"xla_flags.apply() after a jax backend started: XLA would ignore "
                           f"{ignored}; call it before jax.devices() or any computation")
    if flags:
        check(flags, {name: source for name, (_, source) in merged.items()})
    if flags or "XLA_FLAGS" in os.environ:
        os.environ["XLA_FLAGS"] = " ".join(flags)
    if env_mem_fraction() is None:
        os.environ[MEM_FRACTION_VARS[0]] = str(cfg_xla.mem_fraction)  # read at the GPU's start
    return flags
