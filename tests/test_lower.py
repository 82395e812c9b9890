"""The whole loop lowers for TPU and GPU from this CPU host (`specjax lower`, specjax/bench/lower.py):
prefill and the decode loop of every drafter, exported with abstract Llama-3-8B-shaped bf16
weights, sampled accept included; the rejection kernel is in the decode loop as the device's
custom call, no host callback is; CPU-only choices do not leak into accelerator lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import rejection_sampling as rs
from pallas_kernels.platform import lowering_for, target_platform
from specjax.bench.lower import DRAFTERS, lower_loop


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_prefill_and_decode_lower_for_the_device(platform, drafter):
    got = lower_loop(platform, "llama-8b", drafter, num_draft=7, batch_size=8, temperature=1.0)
    for fn in ("prefill", "decode"):
        assert got[fn]["ok"], (fn, got[fn])
        assert got[fn]["host_callbacks"] == [], (fn, got[fn])
    kernel = (
        "tpu_custom_call"
        if platform == "tpu"
        else {"triton": "__gpu$xla.gpu.triton"}.get(rs.gpu_kernel_backends()[0], "mosaic_gpu")
    )
    calls = got["decode"]["custom_calls"]
    if drafter == "none":  # no drafts, no rejection sampling
        assert not any(c in calls for c in ("tpu_custom_call", "__gpu$xla.gpu.triton"))
    else:
        assert any(c.startswith(kernel) for c in calls), calls


def test_cpu_only_choices_follow_the_platform_lowered_for():
    """`linear`'s few-row multiply-reduce is CPU's; a TPU or GPU export gets the matmul, as do
    EAGLE-3's gate (off) and the default dtype (bf16)."""
    from specjax.drafters.eagle3 import default_min_confidence
    from specjax.models.llama import linear
    from specjax.models.loading import default_dtype

    w, x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((4, 128), jnp.bfloat16)

    def ops(platform):
        with lowering_for(platform):
            # a fresh function per platform: jit caches traces by function
            return jax.export.export(jax.jit(lambda a, b: linear(a, b)), platforms=[platform])(w, x).mlir_module()

    assert "dot_general" in ops("tpu") and "dot_general" in ops("cuda")
    assert "dot_general" not in ops("cpu")
    assert target_platform() == jax.default_backend()
    with lowering_for("tpu"):
        assert default_min_confidence() == 0.0 and default_dtype() == "bfloat16" and target_platform() == "tpu"
    with lowering_for("cuda"):
        assert target_platform() == "gpu"
    assert default_min_confidence() > 0 and default_dtype() == "float32"  # this host: CPU


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "gpt-5"], "--shape must be one of"),
        (["--platforms", "metal"], "unknown platform"),
        (["--drafter", "medusa"], "--drafter must be one of"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_cli_bad_input_one_line_exit_2(argv, message, capsys):
    from specjax.cli import main

    assert main(["lower", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
