"""Graph passes on an exported (ATen-level, functionalized) graph before it becomes a DAG.

``fold_batchnorm``: an inference-mode BatchNorm that only follows a convolution is an affine map per
output channel, so it folds into the convolution's weight and bias (as TensorRT and every inference
compiler do). One kernel instead of two, and no intermediate tensor: on an H200 at batch 1 a
BatchNorm kernel costs about as much as a small convolution.

    w' = w * s,  b' = (b - mean) * s + beta,  with  s = gamma / sqrt(var + eps)   (per channel)

The folded parameters are computed in float64 and stored in the weight's dtype, so the result
differs from eager only by rounding.

``restore_batchnorm``: functionalization turns every remaining BatchNorm (one that follows a
concatenation or an activation, as in DenseNet) into ``_native_batch_norm_legit_no_training``, which
always runs PyTorch's own kernel; eager ``aten.batch_norm`` picks cuDNN's, measured faster on the
H200. In inference mode ``batch_norm`` mutates nothing, so putting it back keeps the graph pure.

``channels_last``: every 4-D convolution weight stored NHWC, so that the convolutions run in NHWC
and the activations between them stay NHWC (cuDNN follows the weight's layout; Inductor makes the
same choice for convolution nets). A ``view`` of such an activation may meet strides it cannot view
(a flatten of an NHWC map), so those views become ``reshape`` (a view where one exists, a copy only
where not); views elsewhere stay views.

``fuse_convolutions`` (CUDA only; by default on the channels-last candidate alone, compile's
``fuse_convolutions=None``): cuDNN's backend in PyTorch adds a convolution's bias with
a kernel of its own, and a folded BatchNorm gives every convolution a bias. A 2-D convolution (one
group, with a bias) followed only by a ReLU, a ReLU6 (``hardtanh(0, 6)``), or a residual add and
then a ReLU becomes ``cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``: cuDNN's fused
convolution, bias, (add,) ReLU: one call where there were three or four kernels (convolution, bias,
(add,) activation), so two fewer for a ReLU, three for an add and a ReLU, and one for a ReLU6, which
keeps a ``clamp_max(6)`` after it.

``fuse_epilogues`` (compile's ``fuse_epilogues``; on by default on CUDA where Triton imports): a
convolution with a bias whose only reader is a SiLU, a sigmoid, a ReLU6, or a residual add (then
maybe one of those) runs without its bias, and :func:`epilogue.bias_act` does bias, add and
activation in one kernel: one or two kernels fewer each. ReLUs are left to ``fuse_convolutions``
(cuDNN does convolution, bias, add and ReLU in one call, which the channels-last candidate uses).

``fuse_gates`` (compile's ``fuse_gates``; on by default on CUDA where Triton imports): a
squeeze-excitation gate, ``x * act2(conv2(act1(conv1(pooled))))`` with 1x1 convolutions on a pooled
``[N, C, 1, 1]`` map, runs as :func:`excitation.hidden` and :func:`excitation.excite` (two Triton
kernels) where eager runs two GEMVs, their bias epilogues and the multiply. Before the convolution
passes, which would otherwise take the gate's convolutions.

``split_linears`` (CUDA only; compile's ``split_gemms``): every float32 ``aten.linear`` becomes
:func:`gemm.linear`, which splits the GEMM's reduction where that was timed faster for its shape (a
small batch's few output rows leave most SMs idle; see :mod:`gpuloom.engine.gemm`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx as fx

from . import epilogue, excitation, gemm

_CONVS = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default}
_BN = torch.ops.aten._native_batch_norm_legit_no_training.default


def _attr(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if node is None:
        return None
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise LookupError
    return operator.attrgetter(node.target)(gm)


def _set_attr(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Replace the parameter or buffer ``target`` (a dotted path) of ``gm`` with ``value``."""
    path, _, name = target.rpartition(".")
    owner = gm.get_submodule(path) if path else gm
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def _first_output_users(bn: fx.Node) -> list[fx.Node] | None:
    """The ``getitem(bn, 0)`` users of a batch-norm node, or None if anything else reads it."""
    users = list(bn.users)
    if all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users):
        return users
    return None


def _replace_bn(gm: fx.GraphModule, bn: fx.Node, users: list[fx.Node], new: fx.Node) -> None:
    for u in users:
        u.replace_all_uses_with(new)
        gm.graph.erase_node(u)
    gm.graph.erase_node(bn)


def fold_batchnorm(gm: fx.GraphModule) -> int:
    """Fold every ``conv -> batch_norm (inference)`` pair of ``gm`` in place. Returns how many."""
    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not _BN:
            continue
        conv = bn.args[0]
        if not (isinstance(conv, fx.Node) and conv.op == "call_function" and conv.target in _CONVS):
            continue
        if len(conv.users) != 1:
            continue  # someone else reads the un-normalized output
        users = _first_output_users(bn)
        if users is None:
            continue
        try:
            gamma, beta, mean, var = (_attr(gm, a) for a in bn.args[1:5])
            weight = _attr(gm, conv.args[1])
            bias = _attr(gm, conv.args[2]) if len(conv.args) > 2 else None
        except LookupError:
            continue  # parameters computed at run time: leave the pair alone
        eps = float(bn.args[6])
        scale = (gamma.double() if gamma is not None else 1.0) / torch.sqrt(var.double() + eps)
        shape = (-1,) + (1,) * (weight.dim() - 1)
        new_w = (weight.double() * scale.reshape(shape)).to(weight.dtype)
        b = bias.double() if bias is not None else torch.zeros_like(mean, dtype=torch.float64)
        new_b = ((b - mean.double()) * scale + (beta.double() if beta is not None else 0.0)).to(weight.dtype)
        w_name, b_name = f"_gpuloom_folded_w{folded}", f"_gpuloom_folded_b{folded}"
        gm.register_buffer(w_name, new_w)
        gm.register_buffer(b_name, new_b)
        with gm.graph.inserting_before(conv):
            w_node = gm.graph.get_attr(w_name)
            b_node = gm.graph.get_attr(b_name)
        args = list(conv.args)
        args[1] = w_node
        if len(args) > 2:
            args[2] = b_node
        else:
            args.append(b_node)
        conv.args = tuple(args)
        _replace_bn(gm, bn, users, conv)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded


def restore_batchnorm(gm: fx.GraphModule) -> int:
    """Turn leftover inference ``_native_batch_norm_legit_no_training`` nodes back into
    ``aten.batch_norm`` (eager's dispatch, cuDNN on the GPU). Returns how many."""
    restored = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not _BN:
            continue
        users = _first_output_users(bn)
        if users is None:
            continue
        x, weight, bias, mean, var, momentum, eps = bn.args[:7]
        with gm.graph.inserting_before(bn):
            new = gm.graph.call_function(
                torch.ops.aten.batch_norm.default, (x, weight, bias, mean, var, False, momentum, eps, True)
            )
        new.meta = dict(users[0].meta) if users else {}
        _replace_bn(gm, bn, users, new)
        restored += 1
    if restored:
        gm.recompile()
    return restored


# Out-of-place elementwise ops that have an in-place twin with the same semantics when the first
# argument already has the result's shape and dtype.
_INPLACE_TWINS = {
    torch.ops.aten.relu.default: torch.ops.aten.relu_.default,
    torch.ops.aten.add.Tensor: torch.ops.aten.add_.Tensor,
    torch.ops.aten.hardtanh.default: torch.ops.aten.hardtanh_.default,
    torch.ops.aten.silu.default: torch.ops.aten.silu_.default,
    torch.ops.aten.mul.Tensor: torch.ops.aten.mul_.Tensor,
}


def reinplace_elementwise(gm: fx.GraphModule) -> int:
    """Run ReLU / residual add / ... in place on an intermediate that nothing else reads.

    Functionalization made every op out of place; eager PyTorch models run ReLU and the residual
    add in place, which keeps the working set (and L2 traffic) smaller at large batches. Safe for
    multi-stream execution because the overwritten value has exactly one reader: the op itself.
    Returns how many ops were rewritten. Experimental: off by default until measured.
    """
    rewritten = 0
    outputs = {n for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes}
    for node in gm.graph.nodes:
        twin = _INPLACE_TWINS.get(node.target) if node.op == "call_function" else None
        if twin is None or not node.args:
            continue
        target = node.args[0]
        if not isinstance(target, fx.Node) or target.op != "call_function" or len(target.users) != 1:
            continue
        if target in outputs or target.target is operator.getitem:
            continue
        a, out = target.meta.get("val"), node.meta.get("val")
        if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor):
            continue
        if a.dtype != out.dtype or a.shape != out.shape:
            continue
        if getattr(target.target, "_schema", None) is not None and any(
            r.alias_info is not None for r in target.target._schema.returns
        ):
            continue  # the input is itself a view of something else
        node.target = twin
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


_CONV_RELU = torch.ops.aten.cudnn_convolution_relu.default
_CONV_ADD_RELU = torch.ops.aten.cudnn_convolution_add_relu.default
# convolutions whose weight is args[1], fused ones (fuse_convolutions) included
_CONV2D = {torch.ops.aten.conv2d.default, torch.ops.aten.conv2d.padding, torch.ops.aten.convolution.default,
           _CONV_RELU, _CONV_ADD_RELU}
_STRIDED_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _four_d(node: fx.Node) -> bool:
    """Whether ``node``'s value is a 4-D tensor (the layouts NHWC applies to); unknown counts as yes."""
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.dim() == 4


def channels_last(gm: fx.GraphModule) -> int:
    """Store every 4-D convolution weight of ``gm`` channels-last, in place (see the module
    docstring). Layout is followed forward from those convolutions through 4-D values: a view of such
    a value becomes a reshape (a view elsewhere, as in a transformer after its patch embedding, stays
    a view and no DAG node), and a 4-D graph output is made contiguous again, so callers get eager's
    strides. Returns how many weights; a graph without such convolutions is left as it is."""
    converted: set[str] = set()
    nhwc: set[fx.Node] = set()  # values that may now be channels-last
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _CONV2D or len(node.args) < 2:
            continue
        w = node.args[1]
        if not isinstance(w, fx.Node) or w.op != "get_attr":
            continue
        if w.target not in converted:
            weight = _attr(gm, w)
            if weight is None or weight.dim() != 4:
                continue
            _set_attr(gm, w.target, weight.detach().contiguous(memory_format=torch.channels_last))
            converted.add(w.target)
        nhwc.add(node)
    if not converted:
        return 0
    for node in gm.graph.nodes:  # in graph order: producers before their users
        if node in nhwc or node.op != "call_function" or not any(a in nhwc for a in node.all_input_nodes):
            continue
        if node.target in _STRIDED_VIEWS:
            node.target = torch.ops.aten.reshape.default
        if _four_d(node):
            nhwc.add(node)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for value in [a for a in output.all_input_nodes if a in nhwc and _four_d(a)]:
        with gm.graph.inserting_before(output):
            dense = gm.graph.call_function(torch.ops.aten.clone.default, (value,),
                                           {"memory_format": torch.contiguous_format})
        dense.meta = dict(value.meta)
        output.replace_input_with(value, dense)
    gm.recompile()
    return len(converted)


_RELU = torch.ops.aten.relu.default
_RELU6 = torch.ops.aten.relu6.default  # F.relu6 (nn.ReLU6 exports as hardtanh(0, 6))
_HARDTANH = torch.ops.aten.hardtanh.default
_ADD = torch.ops.aten.add.Tensor
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what cuDNN's fused convolutions take


def _conv2d_params(node: fx.Node) -> tuple | None:
    """(x, weight, bias, stride, padding, dilation, groups) of an ``aten.conv2d.default`` node with
    every default filled in and 2-element lists, or None for anything else."""
    if node.op != "call_function" or node.target is not torch.ops.aten.conv2d.default:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = (None, None, None, [1, 1], [0, 0], [1, 1], 1)
    vals = list(node.args) + [node.kwargs.get(k, d) for k, d in zip(names[len(node.args):], defaults[len(node.args):])]
    x, w, b, stride, padding, dilation, groups = vals
    pairs = []
    for v in (stride, padding, dilation):
        v = [v] if isinstance(v, int) else list(v)
        if len(v) == 1:
            v = v * 2
        if len(v) != 2 or not all(isinstance(i, int) for i in v):
            return None
        pairs.append(v)
    return (x, w, b, *pairs, groups)


def _only_user(node: fx.Node, outputs: set) -> fx.Node | None:
    users = list(node.users)
    if len(users) != 1 or node in outputs or users[0].op != "call_function":
        return None
    return users[0]


def _same_tensor_type(a: fx.Node, b: fx.Node) -> bool:
    """Both values known, of one shape and dtype: a batched 4-D map of a dtype cuDNN fuses."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.dim() == 4 and va.dtype in _FUSED_DTYPES)


def _output_values(g: fx.Graph) -> set[fx.Node]:
    """The values ``g`` returns: a fusion must leave each as it is (callers read it)."""
    return {a for n in g.nodes if n.op == "output" for a in n.all_input_nodes}


def _relinted(gm: fx.GraphModule, rewritten: int) -> int:
    """``rewritten``, after checking and recompiling ``gm`` where a pass rewrote anything."""
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _biased_convolutions(g: fx.Graph, outputs: set) -> Iterator[tuple[fx.Node, tuple, fx.Node]]:
    """Each 2-D convolution of ``g`` with a bias whose value has one reader and is no graph output:
    ``(convolution, its _conv2d_params, the reader)``, in graph order (a pass may rewrite each)."""
    for conv in list(g.nodes):
        params = _conv2d_params(conv)
        if params is None or not isinstance(params[0], fx.Node) or not isinstance(params[2], fx.Node):
            continue
        user = _only_user(conv, outputs)
        if user is not None:
            yield conv, params, user


def _is_relu6(node: fx.Node) -> bool:
    """``hardtanh(x, 0, 6)`` (how ``nn.ReLU6`` exports) or ``relu6(x)``."""
    return (node.target is _HARDTANH and tuple(node.args[1:3]) == (0.0, 6.0) and not node.kwargs
            or node.target is _RELU6 and len(node.args) == 1 and not node.kwargs)


def _residual_of(conv: fx.Node, add: fx.Node) -> fx.Node | None:
    """The other operand of ``add`` when it is a plain two-operand add of ``conv``'s value and another
    value of its shape and dtype (a residual connection), else None."""
    if add.target is not _ADD or add.kwargs or len(add.args) != 2:
        return None
    z = add.args[1] if add.args[0] is conv else add.args[0]
    if not isinstance(z, fx.Node) or z is conv or not _same_tensor_type(conv, z):
        return None
    return z


def fuse_convolutions(gm: fx.GraphModule) -> int:
    """Fuse convolution + bias (+ residual add) + ReLU / ReLU6 into cuDNN's fused convolutions, in
    place (see the module docstring). Only for graphs that run on CUDA with cuDNN: the fused ops have
    no CPU kernel. Returns how many convolutions were fused."""
    g = gm.graph
    outputs = _output_values(g)
    fused = 0
    for conv, params, user in _biased_convolutions(g, outputs):
        x, w, b, stride, padding, dilation, groups = params
        if groups != 1:
            continue
        relu6 = _is_relu6(user)
        if (user.target is _RELU or relu6) and _same_tensor_type(conv, user):
            with g.inserting_before(user):
                new = g.call_function(_CONV_RELU, (x, w, b, stride, padding, dilation, groups))
                new.meta = dict(user.meta)
                last = new
                if relu6:
                    last = g.call_function(torch.ops.aten.clamp_max.default, (new, 6.0))
                    last.meta = dict(user.meta)
            user.replace_all_uses_with(last)
            g.erase_node(user)
            g.erase_node(conv)
            fused += 1
            continue
        z = _residual_of(conv, user)
        relu = _only_user(user, outputs) if z is not None else None
        if relu is None or relu.target is not _RELU or not _same_tensor_type(conv, relu):
            continue
        with g.inserting_before(relu):
            new = g.call_function(_CONV_ADD_RELU, (x, w, z, 1.0, b, stride, padding, dilation, groups))
            new.meta = dict(relu.meta)
        relu.replace_all_uses_with(new)
        for n in (relu, user, conv):
            g.erase_node(n)
        fused += 1
    return _relinted(gm, fused)


_SILU = torch.ops.aten.silu.default
_SIGMOID = torch.ops.aten.sigmoid.default


def _epilogue_activation(node: fx.Node | None) -> str | None:
    """The :data:`epilogue.ACTIVATIONS` name of ``node``'s op, or None for any other op."""
    if node is None:
        return None
    if node.target is _SILU and len(node.args) == 1 and not node.kwargs:
        return "silu"
    if node.target is _SIGMOID and len(node.args) == 1 and not node.kwargs:
        return "sigmoid"
    if _is_relu6(node):
        return "relu6"
    return None


def fuse_epilogues(gm: fx.GraphModule) -> int:
    """Move each convolution's bias, residual add and SiLU / sigmoid / ReLU6 into one
    :func:`epilogue.bias_act`, in place (see the module docstring). Returns how many convolutions."""
    g = gm.graph
    outputs = _output_values(g)
    fused = 0
    for conv, params, user in _biased_convolutions(g, outputs):
        x, w, b, stride, padding, dilation, groups = params
        residual, last = None, user
        act = _epilogue_activation(user)
        if act is None:
            residual = _residual_of(conv, user)
            if residual is None:
                continue
            after = _only_user(user, outputs)
            if after is not None and after.target is _RELU:
                continue  # cuDNN's convolution + bias + add + ReLU (fuse_convolutions) does all four
            act = _epilogue_activation(after)
            if act is not None and _same_tensor_type(conv, after):
                last = after
            else:
                act = "none"
        if not _same_tensor_type(conv, last):
            continue
        with g.inserting_before(conv):
            bare = g.call_function(torch.ops.aten.conv2d.default, (x, w, None, stride, padding, dilation, groups))
            bare.meta = dict(conv.meta)
        with g.inserting_before(last):
            new = g.call_function(epilogue.bias_act, (bare, b, act, residual))
            new.meta = dict(last.meta)
        last.replace_all_uses_with(new)
        for n in ((last, user, conv) if last is not user else (user, conv)):
            g.erase_node(n)
        fused += 1
    return _relinted(gm, fused)


_HIDDEN_ACTIVATIONS = {_RELU: "relu", _SILU: "silu"}
_GATE_ACTIVATIONS = {_SIGMOID: "sigmoid", torch.ops.aten.hardsigmoid.default: "hardsigmoid"}


def _unary(node: fx.Node | None, table: dict) -> str | None:
    """``table``'s name for ``node``'s op when it is a plain one-operand call of one of its ops."""
    if node is None or node.target not in table or len(node.args) != 1 or node.kwargs:
        return None
    return table[node.target]


def _pointwise_on_pooled(gm: fx.GraphModule, node: fx.Node | None) -> tuple | None:
    """(input, weight, bias) of a 1x1 convolution (one group, no padding, with a bias) of a known
    ``[N, C, 1, 1]`` value: a matrix-vector product per sample, as in a squeeze-excitation block."""
    params = _conv2d_params(node) if node is not None else None
    if params is None:
        return None
    x, w, b, _stride, padding, _dilation, groups = params
    if groups != 1 or padding != [0, 0] or not all(isinstance(v, fx.Node) for v in (x, w, b)):
        return None
    try:
        weight = _attr(gm, w)
    except LookupError:
        return None
    val = x.meta.get("val")
    if (not isinstance(val, torch.Tensor) or val.dim() != 4 or tuple(val.shape[2:]) != (1, 1) or weight is None
            or weight.dim() != 4 or tuple(weight.shape[1:]) != (val.shape[1], 1, 1)):
        return None
    return x, w, b


_MUL = torch.ops.aten.mul.Tensor


def _scaled_by(gate: fx.Node, mul: fx.Node | None) -> fx.Node | None:
    """The map ``mul`` scales by ``gate`` (a ``[N, C, 1, 1]`` value) when it is ``x * gate`` or
    ``gate * x`` for a 4-D ``x`` of as many samples and channels and the same dtype, else None."""
    if mul is None or mul.target is not _MUL or mul.kwargs or len(mul.args) != 2:
        return None
    x = mul.args[1] if mul.args[0] is gate else mul.args[0]
    vx, vg = (x.meta.get("val") if isinstance(x, fx.Node) else None), gate.meta.get("val")
    if x is gate or not isinstance(vx, torch.Tensor) or not isinstance(vg, torch.Tensor) or vx.dim() != 4:
        return None
    if tuple(vx.shape[:2]) != tuple(vg.shape[:2]) or vx.dtype != vg.dtype:
        return None
    return x


def fuse_gates(gm: fx.GraphModule) -> int:
    """Make each squeeze-excitation gate two kernels, in place: ``x * act2(conv2(act1(conv1(pooled))))``
    with 1x1 convolutions on a ``[N, C, 1, 1]`` map, ReLU / SiLU then sigmoid / hardsigmoid (every value
    read once) becomes :func:`excitation.hidden` and :func:`excitation.excite`. Run before the
    convolution passes, which would take its convolutions apart. Returns how many gates."""
    g = gm.graph
    outputs = _output_values(g)
    fused, erased = 0, set()
    for conv1 in list(g.nodes):
        if conv1 in erased:  # a later node of a gate already fused
            continue
        first = _pointwise_on_pooled(gm, conv1)
        act1 = _only_user(conv1, outputs) if first is not None else None
        hidden_act = _unary(act1, _HIDDEN_ACTIVATIONS)
        conv2 = _only_user(act1, outputs) if hidden_act is not None else None
        second = _pointwise_on_pooled(gm, conv2)
        if second is None or second[0] is not act1:
            continue
        act2 = _only_user(conv2, outputs)
        gate_act = _unary(act2, _GATE_ACTIVATIONS)
        mul = _only_user(act2, outputs) if gate_act is not None else None
        x = _scaled_by(act2, mul)
        if x is None:
            continue
        with g.inserting_before(act1):
            h = g.call_function(excitation.hidden, (*first, hidden_act))
            h.meta = dict(act1.meta)
        with g.inserting_before(mul):
            new = g.call_function(excitation.excite, (x, h, *second[1:], gate_act))
            new.meta = dict(mul.meta)
        mul.replace_all_uses_with(new)
        for n in (mul, act2, conv2, act1, conv1):
            g.erase_node(n)
            erased.add(n)
        fused += 1
    return _relinted(gm, fused)


def split_linears(gm: fx.GraphModule) -> int:
    """Make every float32 ``aten.linear`` of ``gm`` a :func:`gemm.linear` (split K where timed faster),
    in place. Returns how many. Only for graphs that run on CUDA (elsewhere it would run unsplit)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.float32:
            node.target = gemm.linear
            n += 1
    if n:
        gm.recompile()
    return n
