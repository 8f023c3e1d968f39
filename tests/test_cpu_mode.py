"""CPU mode: what it maps, that it is reversible and idempotent, and when it refuses to act.

Each case runs in a fresh interpreter: enable() must come before megatron is imported, and the
test process itself may have imported megatron already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from launch import REPO


def _run(code: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc


def _ok(code: str) -> str:
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cuda_calls_map_to_cpu_and_disable_restores_them():
    out = _ok(
        """
        import torch
        originals = (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda, torch.Tensor.type)
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        cpu_mode.enable()  # idempotent
        assert cpu_mode.is_enabled()
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu", t.device
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device(), pin_memory=True).device.type \\
            == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions still convert
        assert not torch.cuda.is_available()  # CPU mode never pretends a GPU exists
        torch.cuda.synchronize()
        # The device RNG is the CPU generator; megatron's tracker forks it.
        from megatron.core.tensor_parallel import random as mr
        torch.cuda.manual_seed(7)
        a = torch.rand(4)
        torch.cuda.manual_seed(7)
        assert torch.equal(a, torch.rand(4))
        state = mr._get_cuda_rng_state()
        b = torch.rand(4)
        mr._set_cuda_rng_state(state)
        assert torch.equal(b, torch.rand(4))
        cpu_mode.disable()
        cpu_mode.disable()  # idempotent
        assert not cpu_mode.is_enabled()
        now = (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda, torch.Tensor.type)
        assert all(x is y for x, y in zip(originals, now))
        assert torch.zeros(1).type() == "torch.FloatTensor"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_megatron_rng_tracker_forks_distinct_streams():
    out = _ok(
        """
        import torch
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        torch.manual_seed(1)
        tracker = get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 1234)
        outside = torch.get_rng_state()
        with tracker.fork():
            inside = torch.rand(3)
        assert torch.equal(outside, torch.get_rng_state())  # fork restored the default stream
        with tracker.fork():
            again = torch.rand(3)
        assert not torch.equal(inside, again)  # the forked stream advanced
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_refuses_after_megatron_was_imported():
    proc = _run(
        """
        import megatron.core
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        """
    )
    assert proc.returncode != 0
    assert "megatron.core was imported before" in proc.stderr


def test_refuses_on_a_machine_with_cuda():
    proc = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True  # what a GPU machine reports
        from megatron_diffckpt import cpu_mode
        try:
            cpu_mode.enable()
        except cpu_mode.CpuModeError as exc:
            assert not cpu_mode.is_enabled()
            assert not hasattr(torch.zeros, "__diffckpt_cpu_mode__")  # nothing was patched
            print("refused:", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused: CPU mode refuses to act on a machine with CUDA" in proc.stdout


def test_torch_compile_waits_for_the_first_call_and_computes_the_same():
    out = _ok(
        """
        import sys
        import torch
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        import megatron.core.models.gpt  # its fused functions are wrapped at import
        assert "torch._dynamo" not in sys.modules, "wrapping imported the compiler"
        from megatron.core.fusions.fused_bias_gelu import bias_gelu
        assert bias_gelu.__wrapped__.__code__.co_name == "bias_gelu"
        traced = []

        @torch.compile(backend="eager")
        def scaled(x):
            traced.append(torch.compiler.is_compiling())
            return x * 2

        x = torch.arange(3.0)
        assert torch.equal(scaled(x), x * 2) and torch.equal(scaled(x), x * 2)
        assert "torch._dynamo" in sys.modules and traced == [True, True], traced  # compiled
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_with_compilation_off_a_compiled_function_runs_as_written():
    out = _ok(
        """
        import sys
        import torch
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        cpu_mode._compile_off.append(True)  # what enable_training() switches on
        calls = []

        @torch.compile(fullgraph=True)
        def scaled(x):
            calls.append(torch.compiler.is_compiling())
            return x * 2

        x = torch.arange(3.0)
        assert torch.equal(scaled(x), x * 2) and torch.equal(scaled(x), x * 2)
        assert calls == [False, False], calls  # Python ran each call: nothing was traced
        assert "torch._dynamo" not in sys.modules
        cpu_mode.disable()
        assert not cpu_mode._compile_off and torch.compile.__module__ == "torch"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_helper_started_from_a_process_in_cpu_mode_applies_it_at_import():
    out = _ok(
        """
        import os, subprocess, sys
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        helper = "from megatron_diffckpt import cpu_mode; cpu_mode.enable_if_inherited(); " \\
            "print(cpu_mode.is_enabled())"
        inherited = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True)
        cpu_mode.disable()
        assert "DIFFCKPT_CPU_MODE" not in os.environ
        plain = subprocess.run([sys.executable, "-c", helper], capture_output=True, text=True)
        print(inherited.stdout.strip(), plain.stdout.strip())
        """
    )
    assert out.split() == ["True", "False"]


def test_async_staging_copies_shared_tensors_and_only_those():
    out = _ok(
        """
        import torch
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        from megatron.core.dist_checkpointing.strategies.filesystem_async import (
            FileSystemWriterAsync,
        )
        own, shared = torch.arange(3.0), torch.arange(3.0).share_memory_()
        [(_, _, (_, staged))] = FileSystemWriterAsync.preload_tensors(
            [("f", "k", ([], [("own", own), ("shared", shared)]))]
        )
        (_, a), (_, b) = staged
        shared.add_(1)  # training goes on after staging
        assert a is own and b is not shared and torch.equal(b, torch.arange(3.0))
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_the_moe_pieces_megatron_takes_from_transformer_engine_have_their_torch_path():
    """The MoE router's gemm (imported from transformer-engine only in megatron-core 0.16; 0.19
    binds it to ``None`` itself) is ``None`` while CPU mode is on, so megatron's torch.mm path
    runs, and after it as megatron left it (gone where CPU mode bound it); the
    alltoall dispatcher's side stream is the current stream, its event done, its split sizes
    host arrays."""
    out = _ok(
        """
        import torch
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
        had = "te_general_gemm" in vars(moe_utils) and moe_utils.te_general_gemm is not None
        bound_here = any(m is moe_utils and n == "te_general_gemm" for m, n in cpu_mode._bound)
        if not had:  # without transformer-engine
            assert moe_utils.te_general_gemm is None
            x, w = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
            y = moe_utils.router_gating_linear(x, w, None, torch.float32)
            y.sum().backward()
            assert torch.allclose(y, x @ w.t()) and x.grad is not None and w.grad is not None
        assert torch.cuda.Stream() == torch.cuda.current_stream()
        event = torch.cuda.Stream().record_event()
        event.synchronize()
        assert event.query()
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert list(splits) == [3, 1] and not torch.is_tensor(splits)
        t = torch.tensor([2])
        assert token_dispatcher.maybe_move_tensor_to_cpu(t) is t
        cpu_mode.disable()
        if not had:
            assert hasattr(moe_utils, "te_general_gemm") != bound_here
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_megatrons_own_attention_refuses_context_parallelism():
    """Why context parallelism stays refused on CPU: megatron's attention without
    transformer-engine refuses it itself. When a release lifts that, this fails, and the
    refusal in ``config.check_launch`` is to be revisited."""
    out = _ok(
        """
        from megatron_diffckpt import cpu_mode
        cpu_mode.enable()
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig
        config = TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, context_parallel_size=2
        )
        try:
            DotProductAttention(config, 1, AttnMaskType.causal, "self")
        except AssertionError as e:
            print(e)
        """
    )
    assert "Context parallelism is only supported by TEDotProductAttention" in out
