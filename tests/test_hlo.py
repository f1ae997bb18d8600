"""Reading optimized HLO text: executions through loops, collectives' bytes and mesh axes, kernels
and matmul and attention FLOPs (jaxtron/program/flops.py), on a small module written out by hand in XLA's
GPU output format."""

from jaxtron.program import flops, hlo

MESH = {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1}  # device id = data * 4 + fsdp

MODULE = """\
HloModule jit_train_step, entry_computation_layout={()->()}

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_reduce_scatter (w0: f32[64,16]) -> f32[16,16] {
  %w0 = f32[64,16]{1,0} parameter(0)
  ROOT %reduce-scatter.2 = f32[16,16]{1,0} reduce-scatter(%w0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%body (carry: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %carry = (s32[], bf16[64,32]{1,0}) parameter(0)
  %x = bf16[64,32]{1,0} get-tuple-element(%carry), index=1
  %w = bf16[8,16]{1,0} constant({...})
  %all-gather-start = (bf16[8,16]{1,0}, bf16[32,16]{0,1}) all-gather-start(%w), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = bf16[32,16]{0,1} all-gather-done(%all-gather-start)
  %gemm = bf16[64,16]{1,0} fusion(%x, %all-gather-done), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %i = s32[] get-tuple-element(%carry), index=0
  ROOT %tuple = (s32[], bf16[64,32]{1,0}) tuple(%i, %x)
}

%cond (c: (s32[], bf16[64,32])) -> pred[] {
  %c = (s32[], bf16[64,32]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: bf16[64,32], g: f32[64,16]) -> f32[16,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %g = f32[64,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}) tuple(%zero, %a)
  %while = (s32[], bf16[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %gemm.2 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %all-reduce-start = f32[64,16]{1,0} all-reduce-start(%g), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  %all-reduce-done = f32[64,16]{1,0} all-reduce-done(%all-reduce-start)
  %rs-start = ((f32[64,16]{1,0}), f32[16,16]{1,0}) async-start(%all-reduce-done), calls=%wrapped_reduce_scatter
  ROOT %rs-done = f32[16,16]{1,0} async-done(%rs-start)
}
"""


def test_executions_follow_loop_trip_counts():
    module = hlo.parse(MODULE)
    assert module.entry == "main"
    assert module.executions["body"] == 6
    assert module.executions["fused_dot"] == 6  # called from the loop body
    assert module.executions["wrapped_reduce_scatter"] == 1
    assert module.async_bodies == {"wrapped_reduce_scatter"}


def test_collectives_bytes_axes_and_async():
    hosts = [i // 4 for i in range(8)]  # two hosts of four
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse(MODULE), MESH, hosts)}
    gather = rows["all-gather"]
    # six executions of a gather whose result is bf16[32,16]: 1 KiB each, groups along fsdp
    assert (gather["count"], gather["bytes"], gather["axes"], gather["async"]) == (6, 6 * 1024,
                                                                                  ["fsdp"], True)
    assert gather["crosses_hosts"] is False  # fsdp groups {0..3}, {4..7}: one host each
    reduce = rows["all-reduce"]
    assert (reduce["count"], reduce["bytes"], reduce["axes"]) == (1, 64 * 16 * 4, ["data"])
    assert reduce["crosses_hosts"] is True  # {0, 4}: hosts 0 and 1
    scatter = rows["reduce-scatter"]  # inside an async wrapper: async; bytes = its input
    assert (scatter["bytes"], scatter["axes"], scatter["async"]) == (64 * 16 * 4, ["fsdp"], True)


def test_a_start_holding_its_operands_counts_its_results_once():
    """jax 0.12's XLA writes an all-reduce-start as ((operands), results), as the other starts:
    its bytes are the results', not both (which doubled every all-reduce); a combined one's are
    all its results'; jax 0.10's form, the results alone, is read as before (MODULE above)."""
    text = MODULE.replace(
        "%all-reduce-start = f32[64,16]{1,0} all-reduce-start(%g)",
        "%all-reduce-start = ((f32[64,16]{1,0}), f32[64,16]{1,0}) all-reduce-start(%g)")
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse(text), MESH)}
    assert rows["all-reduce"]["bytes"] == 64 * 16 * 4
    combined = hlo.Instruction("all-reduce-start.1", "((f32[4]{0}, bf16[8]{0}), (f32[4]{0}, "
                               "bf16[8]{0}))", "all-reduce-start", "%a, %b)")
    assert hlo.collective_bytes("all-reduce", combined, 2) == 4 * 4 + 8 * 2
    old_combined = hlo.Instruction("all-reduce-start.2", "(f32[4]{0}, bf16[8]{0})",
                                   "all-reduce-start", "%a, %b)")
    assert hlo.collective_bytes("all-reduce", old_combined, 2) == 4 * 4 + 8 * 2


def test_kernels_and_matmul_flops():
    module = hlo.parse(MODULE)
    assert hlo.kernels(module) == {"__triton_gemm": 6, "__cublas$lt$matmul": 1}
    loop_dots = 6 * 2 * 64 * 16 * 32  # the Triton GEMM fusion's dot, six times
    cublas = 2 * 64 * 16 * 32  # out [64, 16], contracting a's dimension 1 (32)
    assert flops.compiled(module) == {"matmul": loop_dots + cublas, "attention": 0, "ragged": 0,
                                      "fp8": 0, "fp8_e5m2": 0, "optimizer": 0}


def test_newton_schulz_matmuls_are_counted_apart():
    """The cuBLAS GEMM under Muon's named scope (jaxtron/step/muon.py's SCOPE, in its op_name)
    goes to `optimizer`, outside `matmul`; the loop's Triton GEMMs stay in `matmul`."""
    text = "\n".join(
        line + ', metadata={op_name="jit(step)/jvp()/newton_schulz/dot_general"}'
        if "custom_call_target=\"__cublas$lt$matmul\"" in line else line
        for line in MODULE.splitlines())
    counted = flops.compiled(hlo.parse(text))
    assert counted["optimizer"] == 2 * 64 * 16 * 32
    assert counted["matmul"] == 6 * 2 * 64 * 16 * 32


FP8_MODULE = """\
HloModule jit_train_step, entry_computation_layout={()->()}

%forward (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{0,1} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%backward (q0: f8e5m2[64,16], q1: f8e4m3fn[16,32]) -> bf16[64,32] {
  %q0 = f8e5m2[64,16]{1,0} parameter(0)
  %q1 = f8e4m3fn[16,32]{0,1} parameter(1)
  ROOT %dot.2 = bf16[64,32]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[64,32], b: f8e4m3fn[32,16], g: f8e5m2[64,16], c: f8e4m3fn[16,32], x: bf16[64,32], y: bf16[32,16]) -> bf16[64,16] {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e4m3fn[32,16]{0,1} parameter(1)
  %g = f8e5m2[64,16]{1,0} parameter(2)
  %c = f8e4m3fn[16,32]{0,1} parameter(3)
  %x = bf16[64,32]{1,0} parameter(4)
  %y = bf16[32,16]{1,0} parameter(5)
  %f = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%forward, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %d = bf16[64,32]{1,0} fusion(%g, %c), kind=kCustom, calls=%backward, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %h = bf16[64,16]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_fp8_matmuls_are_those_with_fp8_operands_and_e5m2_the_backwards():
    """model.fp8's GEMMs: a dot whose operands are all FP8 counts to `fp8`, one of them e5m2 (a
    gradient) to `fp8_e5m2` too; the bf16 dot beside them to neither."""
    each = 2 * 64 * 16 * 32  # the three dots have the same size
    assert flops.compiled(hlo.parse(FP8_MODULE)) == {"matmul": 3 * each, "attention": 0,
                                                     "ragged": 0, "fp8": 2 * each,
                                                     "fp8_e5m2": each, "optimizer": 0}


def test_attention_kernels_are_counted_apart_from_matmuls():
    """A cuDNN attention forward and backward in the loop of 6, beside its Triton GEMM: the
    kernels' FLOPs (2 and 5 matmuls of q[2, 128, 4, 64] against k[2, 128, 2, 64], the causal
    square counted whole) go to `attention`, the GEMMs alone to `matmul`."""
    lines = MODULE.splitlines()
    body = next(i for i, line in enumerate(lines) if line.startswith("%body"))
    at = next(i for i in range(body, len(lines)) if "%i = s32[]" in lines[i])
    lines[at:at] = [
        "  %q = bf16[2,128,4,64]{3,2,1,0} constant({...})",
        "  %k = bf16[2,128,2,64]{3,2,1,0} constant({...})",
        '  %fmha = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), '
        'custom_call_target="__cudnn$fmhaScaleBiasSoftmax"',
        '  %fmha.bwd = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %k, %q), '
        'custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward"']
    module = hlo.parse("\n".join(lines))
    forward = 2 * (2 * 2 * 4 * 128 * 128 * 64)  # 2 matmuls of [T, H] x [H, S], per b and head
    counted = flops.compiled(module)
    assert counted["attention"] == 6 * (forward + forward * 5 // 2)
    assert counted["matmul"] == 6 * 2 * 64 * 16 * 32 + 2 * 64 * 16 * 32
    assert hlo.kernels(module)["__cudnn$fmhaScaleBiasSoftmaxBackward"] == 6


RAGGED_MODULE = """HloModule ragged

ENTRY %main (x: bf16[512,64], w: bf16[4,64,32], s: s32[4], g: bf16[512,32], wt: bf16[4,32,64], xt: bf16[64,512]) -> bf16[512,64] {
  %x = bf16[512,64]{1,0} parameter(0)
  %w = bf16[4,64,32]{2,1,0} parameter(1)
  %s = s32[4]{0} parameter(2)
  %g = bf16[512,32]{1,0} parameter(3)
  %wt = bf16[4,32,64]{2,1,0} parameter(4)
  %xt = bf16[64,512]{1,0} parameter(5)
  %fwd = bf16[512,32]{1,0} custom-call(%x, %w, %s, %s), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/shard_map/ragged_dot_sm90/mpmd_map"}
  %dw = bf16[4,64,32]{2,1,0} custom-call(%s, %s, %xt, %g), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/transpose(jvp())/ragged_contracting_dim_dot_sm90/mpmd_map"}
  %tri = bf16[512,64]{1,0} custom-call(%g, %wt, %s), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/pallas_call" metadata_payload="tokamax:{\\"op\\":\\"RaggedDot\\"}"}
  %other = bf16[512,64]{1,0} custom-call(%x, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/attention/mpmd_map"}
  ROOT %dot = bf16[512,64]{1,0} dot(%g, %wt), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_grouped_matmul_kernels_count_as_ragged_matmuls():
    """tokamax's ragged_dot as a Mosaic GPU call (named by its op_name on jax 0.11: the forward
    and the weights' gradient, [K, R] x [R, N] -> [G, K, N]) and as a Triton call (named by its
    op's payload) count 2 * R * K * N each to `ragged` and are matmul kernels; another Mosaic
    kernel is neither."""
    module = hlo.parse(RAGGED_MODULE)
    each = 2 * 512 * 64 * 32
    counted = flops.compiled(module)
    assert counted["ragged"] == 3 * each
    assert counted["matmul"] == each  # the plain dot alone
    kinds = {inst.name: hlo.is_matmul(inst) for inst in module.computations["main"]}
    assert kinds == {"x": False, "w": False, "s": False, "g": False, "wt": False, "xt": False,
                     "fwd": True, "dw": True, "tri": True, "other": False, "dot": True}


def test_replica_group_formats_agree():
    """The same fsdp groups in the three notations XLA prints."""
    mesh_form = hlo.Instruction("x", "f32[4]", "all-reduce",
                                "%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}")
    iota_form = hlo.Instruction("x", "f32[4]", "all-reduce", "%a), replica_groups=[2,4]<=[8]")
    listed = hlo.Instruction("x", "f32[4]", "all-reduce",
                             "%a), replica_groups={{0,1,2,3},{4,5,6,7}}")
    # A mesh whose positions hold devices in another order: position (i, j) of [4, 2] holds
    # device j * 4 + i, so groups along the first axis are again {0..3} and {4..7}.
    reordered = hlo.Instruction("x", "f32[4]", "all-reduce",
                                "%a), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
                                "device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}")
    groups = [hlo.device_groups(inst, 8) for inst in (mesh_form, iota_form, listed, reordered)]
    assert groups[0] == groups[1] == groups[2] == groups[3] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    transposed = hlo.Instruction("x", "f32[4]", "all-reduce",
                                 "%a), replica_groups=[4,2]<=[2,4]T(1,0)")
    assert hlo.device_groups(transposed, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.mesh_axes(hlo.device_groups(transposed, 8), MESH) == ("data",)


UNANNOTATED_LOOP = """\
%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(3)
  ROOT %lt = pred[] compare(%p, %bound), direction=LT
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %cmp = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%fused_add (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %next = s32[] add(%q, %one)
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %i1 = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i1, %ar)
}

ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]{0}) tuple(%start, %a)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""


def test_trip_count_read_off_the_induction_variable():
    """A loop without known_trip_count (as XLA leaves a peeled, double-buffered microbatch loop):
    from 0, while i < 3, i += 1: three iterations, each with its all-reduce."""
    module = hlo.parse(UNANNOTATED_LOOP)
    assert module.executions["body"] == 3
    (row,) = hlo.collectives(module, MESH)
    assert (row["op"], row["count"], row["bytes"]) == ("all-reduce", 3, 3 * 32)


def test_a_scope_share_weighs_what_runs_under_it():
    """A collective under a named scope whose conditional runs on a share of the loop's
    iterations (the 1F1B ticks' forward and backward, one_f_one_b.Ticks.shares) is counted on
    that share of them, in executions and bytes; others in full."""
    scoped = UNANNOTATED_LOOP.replace(
        "to_apply=%add\n", 'to_apply=%add, metadata={op_name="jit(step)/while/body/'
        '1f1b_forward/cond/all-reduce"}\n')
    assert scoped != UNANNOTATED_LOOP
    shares = {"1f1b_forward": 2 / 3, "1f1b_backward": 0.5}
    (row,) = hlo.collectives(hlo.parse(scoped), MESH, scope_shares=shares)
    assert (row["count"], row["bytes"]) == (2, 2 * 32)
    (row,) = hlo.collectives(hlo.parse(UNANNOTATED_LOOP), MESH, scope_shares=shares)
    assert (row["count"], row["bytes"]) == (3, 3 * 32)


def test_overlap_is_a_matmul_between_start_and_done():
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse(MODULE), MESH)}
    # As written, each start is followed straight by its done (the GEMMs run before or after).
    assert all(row["overlapped"] == row["overlapped_bytes"] == 0 for row in rows.values())
    lines = MODULE.splitlines()
    done = next(i for i, line in enumerate(lines) if "all-gather-done(" in line)
    cublas = next(i for i, line in enumerate(lines) if "__cublas" in line)
    lines.insert(done + 2, lines.pop(done))  # the loop's GEMM now runs while the gather flies
    rs_done = next(i for i, line in enumerate(lines) if "async-done(" in line)
    lines.insert(rs_done - 1, lines.pop(cublas))  # the cuBLAS call inside the reduce-scatter's
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse("\n".join(lines)), MESH)}
    assert (rows["all-gather"]["overlapped"], rows["all-gather"]["overlapped_bytes"]) == (6, 6 * 1024)
    assert rows["reduce-scatter"]["overlapped"] == 1
    assert rows["all-reduce"]["overlapped"] == 0  # the cuBLAS call moved past it


def test_a_loop_that_runs_a_matmul_hides_a_collective_around_it():
    """An all-reduce started before the layers' loop and done after it, with no GEMM of its own
    level between: the loop's body runs a GEMM six times, so the traffic is hidden (the expert
    ring's loop between a layer's weight gather and its done). A loop without one hides
    nothing."""
    lines = MODULE.splitlines()
    start = next(i for i, line in enumerate(lines) if "all-reduce-start(" in line)
    lines.insert(next(i for i, line in enumerate(lines) if " while(" in line), lines.pop(start))
    cublas = lines.pop(next(i for i, line in enumerate(lines) if "__cublas" in line))
    lines.insert(next(i for i, line in enumerate(lines) if "all-reduce-done(" in line) + 1, cublas)
    text = "\n".join(lines)
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse(text), MESH)}
    assert rows["all-reduce"]["overlapped"] == 1
    no_gemm = text.replace("  %gemm = bf16[64,16]{1,0} fusion(%x, %all-gather-done), kind=kCustom, "
                           "calls=%fused_dot, backend_config={\"fusion_backend_config\":"
                           "{\"kind\":\"__triton_gemm\"}}\n", "")
    assert no_gemm != text
    rows = {row["op"]: row for row in hlo.collectives(hlo.parse(no_gemm), MESH)}
    assert rows["all-reduce"]["overlapped"] == 0
