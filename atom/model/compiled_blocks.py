"""torch.compile of the transformer blocks (`train.compile_blocks`).

Eager blocks launch dozens of small kernels per layer (norms, RoPE, activations, the
residual adds) between the matmuls; Inductor fuses them. torchtune's 8B figure on a 4090
(the one this project measures itself against) is with torch.compile.

Every block of a model runs the same code, so one compiled function serves them all: the
block class's forward under torch.compile, called with the block as its first argument.
Since torch 2.5 Dynamo takes a module's parameters as graph inputs
(`inline_inbuilt_nn_modules`), so neither another block nor the swap engine binding a
slot's tensors in place of a block's parameters recompiles it. A forward under `no_grad`
(the checkpointed pass, evaluation) and one that keeps the graph (the recompute, the
backward) are two compiles. Only the plain call is compiled: packed documents (whose
chunk ranges are Python lists that would be compiled into the graph, a new compile per
batch) and generation's cache run the eager forward.

A compile error shows up at a block's first forward, or at its first backward (which
Inductor compiles then); neither may surface in the middle of a step. So `compile_blocks`
first runs one block, on a tensor of the step's shape, through a no-grad forward and a
forward and backward: if that fails (no C++ compiler or Triton, a torch without Inductor,
an op it cannot lower), one warning names the cause and the blocks run eagerly.

A trial without an error is not yet a compiled block: Dynamo keeps the graphs of a function
per code object, shared by every engine in the process, and past its recompile limit
(`torch._dynamo.config.recompile_limit` graphs, reached by a sweep that builds engine
after engine at other shapes) it runs the function eagerly, silently. So each trial call
counts the compiled graphs that accept it: none, and the blocks run eagerly, with the
warning above.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

log = logging.getLogger(__name__)


def wanted(setting: str, device: torch.device) -> bool:
    """train.compile_blocks: auto compiles on CUDA only (on a CPU the compile takes longer
    than the runs it speeds up, for the small models one trains there)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def hidden_state(cfg, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A random hidden state of one micro-batch of `cfg` (atom.config.Config)."""
    m = cfg.model
    return torch.randn(cfg.train.micro_batch, m.seq_len, m.d_model, device=device).to(dtype)


class RanEagerly(RuntimeError):
    """torch.compile ran the block without an error, but no compiled graph served it."""


def _trial(
    block: nn.Module,
    example: torch.Tensor,
    params: Sequence[torch.Tensor],
    context: Callable[[], AbstractContextManager],
    bound: bool,
    compiled: Callable,
) -> None:
    """The compiled block's forward without and with a graph, and its backward. An eager
    forward first fills the model's caches (RoPE tables, window masks): compiled before
    them, each graph would guard on their absence and compile again at its next call.
    `bound`: the parameters are stand-ins for a slot's tensors, which the swap engine's
    no-grad passes bind as plain views (not leaves): so do they here, or that pass would
    compile again in the first step, where a failure could no longer fall back. Each
    compiled call must be served by a compiled graph (`_served`), else RanEagerly."""
    for p in params if bound else ():
        p.requires_grad_(False)
    with torch.no_grad(), context():
        type(block).forward(block, example)
        block(example)
        _served(compiled, block, example)
    for p in params if bound else ():
        p.requires_grad_(True)
    x = example.detach().requires_grad_()
    # as the swap engine's forward runs: under saved-tensor hooks that pack some tensors
    # as other objects (atom/swap/slots.py), so a compile they change is tried here too
    packed = torch.autograd.graph.saved_tensors_hooks(lambda t: (t,), lambda box: box[0])
    with context(), packed:
        out = block(x)
        _served(compiled, block, x)
    torch.autograd.grad(out.float().square().mean(), [x, *params])


def _served(compiled: Callable, block: nn.Module, x: torch.Tensor) -> None:
    """Raise RanEagerly unless one of Dynamo's compiled graphs of the block's forward
    accepts the call compiled(block, x) as things stand now (shapes, grad mode, autocast:
    call it where that call ran). A function that is not torch.compile's (a test's
    stand-in), or a torch whose Dynamo keeps its graphs out of reach, is not checked."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    if fn is None:
        if compiled is type(block).forward:  # torch.compile handed back the function
            raise RanEagerly("torch.compile returned the forward as it is: Dynamo is disabled")
        return
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        call = inspect.signature(fn).bind(block, x)
        call.apply_defaults()
        graphs = _debug_get_cache_entry_list(fn.__code__)
        accepted = sum(bool(g.guard_manager.check(dict(call.arguments))) for g in graphs)
    except Exception as err:  # Dynamo's internals, in another torch: the count is unknown
        log.debug("cannot count the compiled graphs of the blocks (%s): not checked", err)
        return
    if accepted:
        return
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is None:  # its older name
        limit = getattr(torch._dynamo.config, "cache_size_limit", 0)
    if limit and len(graphs) >= limit:
        raise RanEagerly(
            f"Dynamo's recompile limit: {len(graphs)} graphs of {fn.__qualname__} are "
            f"compiled in this process already (torch._dynamo.config.recompile_limit "
            f"{limit}) and none takes this call"
        )
    raise RanEagerly(f"Dynamo ran {fn.__qualname__} eagerly ({len(graphs)} graphs compiled)")


def compile_blocks(
    blocks: Sequence[nn.Module],
    example: torch.Tensor,
    bind: Callable[[nn.Module], tuple[list[torch.Tensor], Callable[[], None]]] | None = None,
    context: Callable[[], AbstractContextManager] = nullcontext,
) -> bool:
    """Compile `blocks` in place once one of them passes the trial; True if compiled.

    `example`: a hidden state of the step's shape, dtype and device. `bind(block)`: for
    template blocks without real parameters (the swap engine's), bind stand-in tensors and
    return them with a function that undoes it; None: the block's own parameters (whose
    trial gradients are returned, never accumulated). `context`: what the forward runs
    under (autocast)."""
    if not blocks:
        return False
    first = blocks[0]
    started = time.perf_counter()
    log.info("compiling the transformer blocks (the first run on a machine takes a minute)")
    compiled = torch.compile(type(first).forward)
    _use(first, compiled)
    if bind is not None:
        params, unbind = bind(first)
    else:
        params = [p for p in first.parameters() if p.requires_grad]
        unbind = lambda: None  # noqa: E731
    try:
        _trial(first, example, params, context, bind is not None, compiled)
    except torch.cuda.OutOfMemoryError:
        uncompile(first)  # one block at this micro-batch does not fit: not the compiler's
        raise
    except Exception as err:  # no compiler, no Triton, an op Inductor cannot lower
        uncompile(first)
        log.warning(
            "the transformer blocks do not compile here (%s: %s): running them eagerly "
            "(train.compile_blocks=off skips the attempt)",
            type(err).__name__,
            str(err).strip().splitlines()[0][:200] if str(err).strip() else "",
        )
        return False
    finally:
        unbind()
    for block in blocks[1:]:
        _use(block, compiled)
    log.info("compiled the transformer blocks in %.0f s", time.perf_counter() - started)
    return True


def _use(block: nn.Module, compiled: Callable) -> None:
    """Route `block`'s plain calls (a hidden state, nothing else) to `compiled`."""
    eager = type(block).forward

    def forward(x, *args, **kwargs):
        if args or any(v is not None for v in kwargs.values()):
            return eager(block, x, *args, **kwargs)  # documents, generation's cache
        return compiled(block, x)

    block.forward = forward  # an instance attribute: nn.Module's __call__ finds it first


def uncompile(block: nn.Module) -> None:
    block.__dict__.pop("forward", None)  # the class's forward again


def is_compiled(block: nn.Module) -> bool:
    return "forward" in block.__dict__


def stand_in_params(device: torch.device, dtype: torch.dtype):
    """`bind` for template blocks built on the meta device (the swap engine binds a slot's
    tensors per visit): a random tensor of each parameter's shape, as a leaf."""

    def bind(block: nn.Module) -> tuple[list[torch.Tensor], Callable[[], None]]:
        saved, tensors = [], []
        for module in block.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                t = (torch.randn(param.shape, device=device) * 0.02).to(dtype).requires_grad_()
                saved.append((module, name, param))
                module._parameters[name] = t
                tensors.append(t)

        def unbind() -> None:
            for module, name, param in saved:
                module._parameters[name] = param

        return tensors, unbind

    return bind
