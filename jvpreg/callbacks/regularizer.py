"""Lightning callbacks that add JVP penalties to an existing LightningModule's training step.

How it attaches (no change to the user's code). At ``on_fit_start`` the callbacks of one Trainer
register with one coordinator per LightningModule, which (1) hooks the regularized module (the
LightningModule itself, or the submodule named by ``module=``) with a :class:`SharedForward` and
(2) wraps ``pl_module.training_step`` (restored at ``teardown``/``on_exception``). In a step where at
least one regularizer is active, the wrapper arms the hooks with every active penalty; the first
call of the module inside ``training_step`` then runs ONE clone forward of ``(1 + sum_i k_i) B`` rows
(pre-hook packs, forward hook unpacks), the user's code receives the plain ``f(x)`` and computes its
loss as usual, and the wrapper adds ``sum_i weight_i(t) * penalty_i`` to the loss it returns (a tensor
or the ``"loss"`` of a dict). One backward then gives exact gradients of task loss + penalties, so
precision plugins (autocast), gradient accumulation (Lightning divides the returned loss), gradient
clipping and DDP (gradients of the one graph are all-reduced as usual) need nothing special.

Steps (``weight`` schedules, ``every_n_steps``) are optimizer steps, ``trainer.global_step``: with
gradient accumulation all micro-batches of one optimizer step are treated alike.

SyncBatchNorm: with ``sync_batchnorm=True`` the engine's clone rule all-reduces the statistics of
the primal rows only. PyTorch's SyncBatchNorm refuses CPU tensors, so the DDP test runs on CPU
without it.

Sharded training (:mod:`jvpreg.callbacks.strategies`): ``ModelParallelStrategy`` (FSDP2) for every
penalty, ``FSDPStrategy`` for input directions; DeepSpeed and XLA FSDP get a clear error at ``setup``,
as does manual optimization (use :func:`regularized_forward` in the training step).
"""
from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import math
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from ..losses.base import (JVPPenalty, Stack, Term, as_terms, check_choice, check_float, check_int,
                           regularized_forward)
from ..losses.row_subset import check_rows
from ..losses.constraints import TRANSFORMS, JVPConstraint, TangentProp
from ..losses.jacobian import JacobianFrobenius, JacobianSpectralNorm
from ..losses.sensitivity import ParameterSensitivity
from ..clone import ENGINES, JVPFallbackWarning
from .scale_check import ScaleCheck
from .shared import SharedForward
from .strategies import check_strategy, destroy_process_group_at_exit

__all__ = [
    "ConstraintRegularizer", "JVPRegularizer", "JacobianRegularizer", "ParameterSensitivityRegularizer",
    "SpectralRegularizer", "TangentPropRegularizer", "regularized_forward",
]

SCHEDULES = ("constant", "linear_warmup", "cosine")


# --------------------------------------------------------------------------- the coordinator


class _Coordinator:
    """Shared by every regularizer callback of one LightningModule: hooks, step wrappers, one forward."""

    def __init__(self, pl_module: LightningModule):
        self.pl_module = pl_module
        self.callbacks: List["JVPRegularizer"] = []
        self.forwards: Dict[str, SharedForward] = {}
        self._saved: Dict[str, Any] = {}
        self._val_penalties: Dict[Any, JacobianFrobenius] = {}  # by output_key; seeded: leave the global RNG alone

    # -- registration -----------------------------------------------------------------------
    def attach(self, cb: "JVPRegularizer") -> None:
        if cb in self.callbacks:
            return
        path = cb.module or ""
        sf = self.forwards.get(path)
        if sf is None:
            sf = SharedForward(_resolve(self.pl_module, cb.module, type(cb).__name__),
                               input_index=cb.input_index, input_key=cb.input_key, engine=cb.engine)
            sf.requested_engine = cb.engine
            sf.requested_row_subset = cb.row_subset
            self.forwards[path] = sf
        elif sf.requested_engine != cb.engine:
            raise ValueError(f"{type(cb).__name__}(name={cb.name!r}): regularizers of module={cb.module!r} share one "
                             f"clone forward and must agree on the engine: got engine={cb.engine!r} and "
                             f"engine={sf.requested_engine!r}.")
        elif sf.requested_row_subset != cb.row_subset:
            raise ValueError(f"{type(cb).__name__}(name={cb.name!r}): regularizers of module={cb.module!r} share one "
                             f"clone forward and must agree on the row subset: got row_subset={cb.row_subset!r} and "
                             f"row_subset={sf.requested_row_subset!r}.")
        elif (sf.input_index, sf.input_key) != (cb.input_index, cb.input_key):
            raise ValueError(f"{type(cb).__name__}(name={cb.name!r}): regularizers of module={cb.module!r} must "
                             f"agree on the input: got input_index={cb.input_index}, input_key={cb.input_key!r} "
                             f"and input_index={sf.input_index}, input_key={sf.input_key!r}.")
        taken = {c.log_name for c in self.callbacks}
        cb.log_name, n = cb.name, 1
        while cb.log_name in taken:  # two regularizers with one name: log them apart
            n += 1
            cb.log_name = f"{cb.name}_{n}"
        self.callbacks.append(cb)
        if len(self.callbacks) == 1:
            self._wrap("training_step", self._training_step)
            self._wrap("validation_step", self._validation_step)

    def detach(self, cb: "JVPRegularizer") -> bool:
        """Unregister ``cb``; the last one restores the module. True when nothing is left."""
        if cb in self.callbacks:
            self.callbacks.remove(cb)
        if self.callbacks:
            return False
        for sf in self.forwards.values():
            sf.remove()
        self.forwards.clear()
        for name, prev in self._saved.items():
            if prev is None:
                self.pl_module.__dict__.pop(name, None)
            else:
                self.pl_module.__dict__[name] = prev
        self._saved.clear()
        return True

    def _wrap(self, name: str, impl) -> None:
        self._saved[name] = self.pl_module.__dict__.get(name)
        orig = getattr(self.pl_module, name)

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            return impl(orig, *args, **kwargs)

        self.pl_module.__dict__[name] = wrapper

    # -- steps ------------------------------------------------------------------------------
    def _training_step(self, orig, *args, **kwargs):
        pl_module = self.pl_module
        trainer = pl_module.trainer
        step = trainer.global_step
        batch = args[0] if args else kwargs.get("batch")
        groups: Dict[str, List[Tuple["JVPRegularizer", float]]] = {}
        for cb in self.callbacks:
            w = cb.weight_at(step)
            if cb.is_active(step, w):
                groups.setdefault(cb.module or "", []).append((cb, w))
        if not groups:
            return orig(*args, **kwargs)
        for path, cbs in groups.items():
            terms, targets = [], []
            for cb, _ in cbs:
                y = cb.target_of(batch)
                terms.extend(cb.terms)
                targets.extend([y] * len(cb.terms))
            self.forwards[path].arm(terms, targets, row_subset=cbs[0][0].row_subset)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_LOSS_FALLBACK, category=JVPFallbackWarning)
                out = orig(*args, **kwargs)
            if out is None:  # the user skipped this batch
                return out
            missing = [p for p in groups if not self.forwards[p].fired]
            if missing:
                where = ", ".join(f"{cbs[0][0].name!r}" for p, cbs in groups.items() if p in missing)
                mods = ", ".join(repr(p or "<the LightningModule>") for p in missing)
                raise RuntimeError(f"JVPRegularizer({where}): the regularized module {mods} was not called during "
                                   "training_step, so no penalty was computed. Pass module='<attribute path>' of the "
                                   "submodule your training_step calls (e.g. module='net').")
            total = None
            task = out if isinstance(out, torch.Tensor) else out.get("loss") if isinstance(out, Mapping) else None
            for path, cbs in groups.items():
                sf = self.forwards[path]
                values = list(sf.values)
                offset = 0
                for cb, w in cbs:
                    n = len(cb.terms)
                    mine, values = values[:n], values[n:]
                    value = None
                    for (_, tw, _), v in zip(cb.terms, mine):
                        v = v if tw == 1.0 else v * tw
                        value = v if value is None else value + v
                    cb._record(pl_module, value, w, sf.batch_size)
                    cb._check_scale(value, w, task if isinstance(task, torch.Tensor) else None, step,
                                    sf.plan.slots[offset].context.output if sf.plan is not None else None)
                    offset += n
                    term = value * w
                    total = term if total is None else total + term
            out = _add_to_loss(out, total)
            loss = out if isinstance(out, torch.Tensor) else out["loss"]
            pl_module.log("train/total_loss", loss.detach().float(), on_step=True, on_epoch=False,
                          prog_bar=any(cb.prog_bar for cb in self.callbacks), batch_size=sf.batch_size)
            return out
        finally:
            for path in groups:
                self.forwards[path].disarm()

    def _validation_step(self, orig, *args, **kwargs):
        cb = next((c for c in self.callbacks if c.log_val_jacobian), None)
        if cb is None:
            return orig(*args, **kwargs)
        sf = self.forwards[cb.module or ""]
        pen = self._val_penalties.get(cb.output_key)
        if pen is None:
            pen = self._val_penalties[cb.output_key] = JacobianFrobenius(name="jacobian_fro", seed=0,
                                                                        output_key=cb.output_key)
        sf.arm([(pen, 1.0, 1.0)])
        try:
            out = orig(*args, **kwargs)
            if sf.values is not None:
                value = sf.values[0].detach().float().clamp_min(0).sqrt()
                self.pl_module.log("val/jacobian_fro", value, on_step=False, on_epoch=True, sync_dist=True,
                                   batch_size=sf.batch_size)
            return out
        finally:
            sf.disarm()


_COORDINATORS: "weakref.WeakKeyDictionary[LightningModule, _Coordinator]" = weakref.WeakKeyDictionary()


#: Fallback warnings of loss functions computed *inside* a cloned forward (Hugging Face models given
#: ``labels=``): the exact fallback of a scalar loss at the end of the graph costs next to nothing, and
#: its JVP is not used, so the callbacks silence them (other fallbacks still warn).
_LOSS_FALLBACK = (r"jvpreg: no clone rule for torch\.(_C\._nn\.)?(cross_entropy_loss|nll_loss\w*|binary_cross_entropy\w*|"
                  r"mse_loss|l1_loss|smooth_l1_loss|huber_loss|kl_div)\b")


def _add_to_loss(out: Any, penalty: torch.Tensor) -> Any:
    if isinstance(out, torch.Tensor):
        return out + penalty.to(out.dtype)
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        new = dict(out)
        new["loss"] = out["loss"] + penalty.to(out["loss"].dtype)
        return new
    raise TypeError("JVPRegularizer: training_step must return a loss tensor or a dict with a 'loss' tensor for the "
                    f"penalty to be added, got {type(out).__name__}.")


def _resolve(pl_module: LightningModule, path: Optional[str], where: str) -> torch.nn.Module:
    if not path:
        return pl_module
    try:
        return pl_module.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in pl_module.named_modules() if n]
        close = difflib.get_close_matches(path, names, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        shown = ", ".join(repr(n) for n in names[:10]) + (", ..." if len(names) > 10 else "")
        raise ValueError(f"{where}: module={path!r} is not a submodule of {type(pl_module).__name__}.{hint} "
                         f"Its submodules: {shown or '(none)'}.") from None


def _with_output_key(penalty: Union[JVPPenalty, Stack], key: Any, where: str) -> Union[JVPPenalty, Stack]:
    """``penalty`` scoring the output ``key``: itself when its members already do, else a copy (never mutated)."""
    if key is None:
        return penalty
    members = [p for p, _, _ in as_terms(penalty, where)]
    for p in members:
        if p.output_key is not None and p.output_key != key:
            raise ValueError(f"{where}: output_key={key!r} conflicts with {type(p).__name__}(output_key="
                             f"{p.output_key!r}); set it in one place.")
    if all(p.output_key == key for p in members):
        return penalty
    penalty = copy.deepcopy(penalty)
    for p, _, _ in as_terms(penalty, where):
        p.output_key = key
    return penalty


def _describe(value: Any) -> str:
    """A description of a constructor argument that is equal across processes (for :func:`_fingerprint`)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().flatten().view(torch.uint8)
        return f"tensor{tuple(value.shape)}{value.dtype}:{hashlib.sha1(data.numpy().tobytes()).hexdigest()[:12]}"
    if isinstance(value, JVPPenalty):
        later = getattr(value, "fingerprint_defaults", {})  # options described only when not at their default
        public = {k: v for k, v in vars(value).items()
                  if not k.startswith("_") and k != "training" and not (k in later and v == later[k])}
        return f"{type(value).__name__}({_describe(public)})"
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return type(value).__qualname__


_NOT_FINGERPRINTED = ("penalty", "terms", "steps_applied", "log_name")


def _fingerprint(cb: "JVPRegularizer") -> str:
    """Short digest of a regularizer's whole configuration: its penalties and every option."""
    options = {k: v for k, v in vars(cb).items() if not k.startswith("_") and k not in _NOT_FINGERPRINTED}
    if options.get("row_subset", 0) is None:  # keys of configurations from before the option stay as they were
        del options["row_subset"]
    text = _describe([type(cb).__name__, [(p, w, f) for p, w, f in cb.terms], options])
    return hashlib.sha1(text.encode()).hexdigest()[:8]


# --------------------------------------------------------------------------- the callback


class JVPRegularizer(Callback):
    """Adds ``weight(t) * penalty`` to the loss of an unmodified LightningModule, from the same forward.

    The module's own forward inside ``training_step`` runs once on the concatenated batch
    ``[x; x + s u_1; ...]``: ``training_step`` sees the plain ``f(x)`` and the returned loss becomes
    ``loss + weight(t) * penalty`` (see the module docstring). Several regularizers on one Trainer
    share ONE forward. Logs ``train/<name>`` (the unweighted penalty), ``train/<name>_weight`` and
    ``train/total_loss`` (the loss returned to Lightning, penalties included).

    Models with structured inputs and outputs (Hugging Face, dict batches) need two names: the
    forward argument that gets the clone batch (``input_key``) and the output tensor that is scored
    (``output_key``). A model that computes its loss inside ``forward`` (Hugging Face with ``labels=``)
    works as is: the loss is computed on the primal rows.

    Weight schedules, with ``t = trainer.global_step``: ``constant``: ``w``; ``linear_warmup``:
    ``w * min(1, (t + 1) / warmup_steps)``; ``cosine``: linear warm-up over ``warmup_steps``, then
    ``w_f + (w - w_f) (1 + cos(pi p)) / 2`` with ``p = (t - warmup_steps) / (total_steps - warmup_steps)``
    clipped to ``[0, 1]`` (``w_f = final_weight``).

    Args:
        penalty: a :class:`~jvpreg.losses.JVPPenalty` or a :class:`~jvpreg.losses.Stack`.
        weight: the penalty weight ``w >= 0`` (after warm-up).
        schedule: ``"constant"``, ``"linear_warmup"`` or ``"cosine"``.
        warmup_steps: optimizer steps of linear warm-up (``>= 1`` for ``"linear_warmup"``).
        total_steps: end of the cosine decay; ``None``: ``trainer.estimated_stepping_batches``.
        final_weight: weight at the end of the cosine decay (default 0).
        every_n_steps: apply the penalty on optimizer steps ``t % n == 0`` only (others run plain).
        batch_fraction: regularize the first ``ceil(f B)`` rows of each batch (``0 < f <= 1``). Clone
            mode needs full-size tangent blocks, so the other rows get zero tangents and are not
            scored: this changes which samples are regularized, not the cost.
        row_subset: carry tangents on a random subset of each batch's rows: a fraction ``f`` in ``(0, 1]``
            (``ceil(f B)`` rows) or a row count; ``None``: every row. This changes the cost: a step runs
            ``B + b`` rows instead of ``2B``; the penalty (a mean over the subset) stays unbiased. Train-mode
            BatchNorm then normalizes the subset and the other rows apart (:mod:`jvpreg.losses.row_subset`).
            Regularizers of one module must agree.
        module: attribute path of the submodule whose forward gets the concatenated batch (e.g.
            ``"net"`` or ``"backbone.encoder"``); ``None``: the LightningModule itself.
        input_index: position of the input among the module's forward arguments.
        input_key: name of the input argument of the module's forward (passed by keyword or by
            position, e.g. ``"pixel_values"``, ``"inputs_embeds"``), or its key in a dict passed at
            ``input_index``. Checked at the first regularized call; errors list the float inputs found.
        output_key: the tensor to regularize when the module returns a tuple, dict or object: an index,
            a key, or an attribute name (``"logits"`` of a Hugging Face ``ModelOutput``). The penalty
            scores that tensor; ``training_step`` still receives the whole output. Sets the penalty's
            ``output_key`` (a copy of ``penalty`` is used when its own ``output_key`` is unset).
        target_index: position of the targets in a tuple/list batch (passed to direction functions
            as ``y``); ``None``: no targets.
        target_key: key of the targets in a dict batch.
        name: log name (default: the penalty's name). Two regularizers with one name on a Trainer log
            as ``<name>`` and ``<name>_2``; their ``state_key`` differs whenever their arguments do.
        log_val_jacobian: at validation, log ``val/jacobian_fro``, a one-projection estimate of
            ``sqrt(mean_b ||J_f(x_b)||_F²)`` on each validation batch (one extra block in the val forward).
        prog_bar: show ``train/<name>`` and ``train/total_loss`` (task loss + weighted penalties) on the
            progress bar (they are logged either way).
        engine: how the clone forward runs (see :func:`jvpreg.jvp`): ``"auto"`` replays a program
            captured once per input signature on its second step (compiled when the network is ``torch.compile``-d),
            ``"eager"`` forces op-by-op clone mode; regularizers of one module must agree.

    Warns:
        PenaltyScaleWarning: once per fit, in ``training_step`` before the optimizer step, when the penalty is
            non-finite or its weighted value is over 100x the task loss in the first 3 regularized steps (one
            host read each; later non-finite values are read once per epoch). See :mod:`.scale_check`.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: out-of-range values or unknown schedule; at ``setup``, an unknown ``module``.
        NotImplementedError: at ``setup``, manual optimization, DeepSpeed/XLA FSDP, or weight directions
            under ``FSDPStrategy`` (see :mod:`jvpreg.callbacks.strategies`).
        RuntimeError: in a step, the regularized module was not called by ``training_step``.
        ValueError, TypeError: in a step, ``input_key``/``input_index`` select no float input, or
            ``output_key`` selects no tensor (the messages list the names available).

    Example::

        >>> reg = JVPRegularizer(JacobianFrobenius(n_projections=1), weight=0.01, schedule="linear_warmup",
        ...                      warmup_steps=500, module="net")
        >>> trainer = Trainer(max_epochs=5, callbacks=[reg])
        >>> trainer.fit(MyLightningModule(), datamodule)          # no change to MyLightningModule
        >>> hf = JacobianRegularizer(0.01, module="model", input_key="pixel_values", output_key="logits")
    """

    def __init__(self, penalty: Union[JVPPenalty, Stack], weight: float, *, schedule: str = "constant",
                 warmup_steps: int = 0, total_steps: Optional[int] = None, final_weight: float = 0.0,
                 every_n_steps: int = 1, batch_fraction: float = 1.0, row_subset: Union[int, float, None] = None,
                 module: Optional[str] = None, input_index: int = 0, input_key: Optional[str] = None, output_key: Union[int, str, None] = None,
                 target_index: Optional[int] = 1, target_key: Optional[str] = None, name: Optional[str] = None,
                 log_val_jacobian: bool = False, prog_bar: bool = True, engine: str = "auto"):
        where = f"{type(self).__name__}(...)"
        if not isinstance(penalty, (JVPPenalty, Stack)):
            raise TypeError(f"{where}: expected penalty to be a jvpreg.losses.JVPPenalty or Stack, "
                            f"got {type(penalty).__name__}.")
        if output_key is not None and (isinstance(output_key, bool) or not isinstance(output_key, (int, str))):
            raise TypeError(f"{where}: expected output_key to be None, an int (index) or a str (key or attribute "
                            f"of the output, e.g. 'logits'), got {output_key!r}.")
        self.output_key = output_key
        self.penalty = _with_output_key(penalty, output_key, where)
        self.weight = check_float(where, "weight", weight, low=0.0)
        self.schedule = check_choice(where, "schedule", schedule, SCHEDULES)
        self.warmup_steps = check_int(where, "warmup_steps", warmup_steps, 0)
        if schedule == "linear_warmup" and self.warmup_steps < 1:
            raise ValueError(f"{where}: schedule='linear_warmup' needs warmup_steps >= 1, got {warmup_steps}.")
        if total_steps is not None:
            check_int(where, "total_steps", total_steps, 1)
            if schedule == "cosine" and total_steps <= self.warmup_steps:
                raise ValueError(f"{where}: expected total_steps > warmup_steps for schedule='cosine', got "
                                 f"total_steps={total_steps}, warmup_steps={warmup_steps}.")
        self.total_steps = total_steps
        self.final_weight = check_float(where, "final_weight", final_weight, low=0.0)
        self.every_n_steps = check_int(where, "every_n_steps", every_n_steps, 1)
        self.batch_fraction = check_float(where, "batch_fraction", batch_fraction, low=0.0, high=1.0, low_open=True)
        self.row_subset = check_rows(where, row_subset)
        if module is not None and (not isinstance(module, str) or not module):
            raise TypeError(f"{where}: expected module to be None or a non-empty attribute path str, got {module!r}.")
        self.module = module
        self.input_index = check_int(where, "input_index", input_index, 0)
        for arg, val in (("input_key", input_key), ("target_key", target_key)):
            if val is not None and (not isinstance(val, str) or not val):
                raise TypeError(f"{where}: expected {arg} to be None or a non-empty str, got {val!r}.")
        self.input_key = input_key
        self.target_index = None if target_index is None else check_int(where, "target_index", target_index, 0)
        self.target_key = target_key
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{where}: expected name to be None or a non-empty str, got {name!r}.")
        self.name = name or (penalty.name if isinstance(penalty, JVPPenalty) else "jvp_penalty")
        for arg, val in (("log_val_jacobian", log_val_jacobian), ("prog_bar", prog_bar)):
            if not isinstance(val, bool):
                raise TypeError(f"{where}: expected {arg} to be a bool, got {val!r}.")
        self.log_val_jacobian = log_val_jacobian
        self.prog_bar = prog_bar
        self.engine = check_choice(where, "engine", engine, ENGINES)
        self.log_name = self.name  # made distinct from other regularizers' at on_fit_start
        self.terms: List[Term] = [(p, w, min(f, self.batch_fraction)) for p, w, f in as_terms(self.penalty, where)]
        self.steps_applied = 0
        self._last_value: Optional[torch.Tensor] = None  # a device tensor: read only when asked for (a host sync)
        self._total_steps: Optional[int] = total_steps
        self._scale = ScaleCheck()  # warns when the penalty is non-finite or dwarfs the task loss (scale_check.py)
        self._state_key = self._generate_state_key(name=self.name, config=_fingerprint(self))

    @property
    def last_value(self) -> Optional[float]:
        """The penalty's value at the last step it ran (``None`` before the first), as a Python float. Kept as a
        tensor until read, so that a training step on an accelerator never waits for it."""
        v = self._last_value
        return None if v is None else float(v)

    @property
    def state_key(self) -> str:
        """``<Class>{'name': ..., 'config': <digest of every argument>}``: distinct for two callbacks of one
        class unless they are configured identically, and equal across processes for one configuration."""
        return self._state_key

    # -- schedule ---------------------------------------------------------------------------
    def weight_at(self, step: int) -> float:
        """The scheduled weight at optimizer step ``step``."""
        w = self.weight
        if self.schedule == "constant":
            return w
        if self.warmup_steps and step < self.warmup_steps:
            return w * (step + 1) / self.warmup_steps
        if self.schedule == "linear_warmup":
            return w
        total = self._total_steps
        if total is None:
            return w
        p = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps)))
        return self.final_weight + (w - self.final_weight) * 0.5 * (1.0 + math.cos(math.pi * p))

    def is_active(self, step: int, weight: Optional[float] = None) -> bool:
        """Whether the penalty runs at optimizer step ``step`` (``every_n_steps``, non-zero weight)."""
        w = self.weight_at(step) if weight is None else weight
        return w > 0 and step % self.every_n_steps == 0

    def target_of(self, batch: Any) -> Any:
        """The targets of ``batch`` (``target_key``/``target_index``), or ``None``."""
        if self.target_key is not None and isinstance(batch, Mapping):
            return batch.get(self.target_key)
        if self.target_index is not None and isinstance(batch, (tuple, list)) and len(batch) > self.target_index:
            return batch[self.target_index]
        return None

    def _reduction_hint(self) -> Optional[str]:
        """The argument that averages this callback's penalty over the output elements, if it sums over them."""
        pens = [p for p, _, _ in self.terms]
        if not pens or not all(isinstance(p, JacobianFrobenius) and p.reduction == "sum" for p in pens):
            return None
        return f"{type(self).__name__ if isinstance(self, JacobianRegularizer) else 'JacobianFrobenius'}" \
               "(..., reduction='mean')"

    def _check_scale(self, value: torch.Tensor, weight: float, task: Optional[torch.Tensor], step: int,
                     output: Optional[torch.Tensor]) -> None:
        """:class:`ScaleCheck` of this step (host reads on the first :data:`CHECK_STEPS` steps only)."""
        hint = self._reduction_hint()
        size = int(output[0].numel()) if hint and isinstance(output, torch.Tensor) and output.dim() > 0 else None
        self._scale.observe(f"{type(self).__name__}(name={self.name!r}, weight={weight:g})", value, weight, task,
                            step=step, output_size=size, reduction_hint=hint)

    def _record(self, pl_module: LightningModule, value: torch.Tensor, weight: float, batch_size: Optional[int]):
        self.steps_applied += 1
        v = self._last_value = value.detach()
        pl_module.log(f"train/{self.log_name}", v.float(), on_step=True, on_epoch=False, prog_bar=self.prog_bar,
                      batch_size=batch_size)
        pl_module.log(f"train/{self.log_name}_weight", float(weight), on_step=True, on_epoch=False,
                      batch_size=batch_size)

    # -- Lightning hooks --------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        where = f"{type(self).__name__}(name={self.name!r})"
        check_strategy(trainer.strategy, self.terms, where)
        destroy_process_group_at_exit()
        if not pl_module.automatic_optimization:
            raise NotImplementedError(f"{where}: only implemented for automatic optimization; this LightningModule "
                                      "sets automatic_optimization=False. Call jvpreg.callbacks.regularized_forward("
                                      "model, x, penalty) inside your training_step and add the penalty to your loss.")
        _resolve(pl_module, self.module, where)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.schedule == "cosine" and self.total_steps is None:
            est = trainer.estimated_stepping_batches
            if not math.isfinite(est):
                raise ValueError(f"{type(self).__name__}(name={self.name!r}): schedule='cosine' needs total_steps= "
                                 "when the Trainer has no max_steps/max_epochs limit.")
            self._total_steps = int(est)
        self._scale.reset()
        coord = _COORDINATORS.get(pl_module)
        if coord is None:
            coord = _COORDINATORS[pl_module] = _Coordinator(pl_module)
        coord.attach(self)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._scale.flush()  # one host read per epoch: a penalty that became non-finite after the checked steps

    def _detach(self, pl_module: LightningModule) -> None:
        coord = _COORDINATORS.get(pl_module)
        if coord is not None and coord.detach(self):
            _COORDINATORS.pop(pl_module, None)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._scale.flush()
        self._detach(pl_module)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach(pl_module)

    def state_dict(self) -> Dict[str, Any]:
        return {"penalty": self.penalty.state_dict(), "steps_applied": self.steps_applied,
                "total_steps": self._total_steps, "last_value": self.last_value}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.penalty.load_state_dict(state_dict["penalty"])
        self.steps_applied = int(state_dict.get("steps_applied", 0))
        last = state_dict.get("last_value")
        self._last_value = None if last is None else torch.tensor(float(last), dtype=torch.float64)
        if self.total_steps is None:
            self._total_steps = state_dict.get("total_steps")


class JacobianRegularizer(JVPRegularizer):
    """Jacobian (Frobenius) regularization: ``weight * JacobianFrobenius`` from the training forward.

    ``penalty = c/(k m) sum_j ||J_f(x) u_j||²`` (Hutchinson, ``E = c * mean_b ||J_f(x_b)||_F²``; ``c = 1/2``
    with ``normalize="hoffman"``, so Hoffman et al.'s ``lambda_JR`` transfers as ``weight``).

    Args:
        weight: the penalty weight.
        n_projections, distribution, normalize, reduction, seed: see :class:`~jvpreg.losses.JacobianFrobenius`
            (``reduction="mean"`` for dense outputs: the penalty per output element).
        **kwargs: the options of :class:`JVPRegularizer` (schedule, every_n_steps, module, ...).

    Example::

        >>> trainer = Trainer(max_epochs=5, callbacks=[JacobianRegularizer(weight=0.01, module="net")])
    """

    def __init__(self, weight: float, n_projections: int = 1, distribution: str = "gaussian",
                 normalize: Optional[str] = None, *, reduction: str = "sum", seed: Optional[int] = None,
                 **kwargs: Any):
        pen = JacobianFrobenius(n_projections, distribution, normalize, reduction=reduction, seed=seed,
                                output_key=kwargs.get("output_key"))
        super().__init__(pen, weight, **kwargs)


class TangentPropRegularizer(JVPRegularizer):
    """Tangent prop: ``weight * (1/m) sum_b sum_t ||J_f(x_b) tau_t(x_b)||²`` for image transformations ``t``.

    Args:
        weight: the penalty weight.
        transforms, gradient: see :class:`~jvpreg.losses.TangentProp`.
        **kwargs: the options of :class:`JVPRegularizer`.

    Example::

        >>> trainer = Trainer(callbacks=[TangentPropRegularizer(weight=1e-3, transforms=("rotate", "scale"))])
    """

    def __init__(self, weight: float, transforms: Union[str, Sequence[str]] = TRANSFORMS, gradient: str = "central",
                 **kwargs: Any):
        super().__init__(TangentProp(transforms, gradient, output_key=kwargs.get("output_key")), weight, **kwargs)


class ConstraintRegularizer(JVPRegularizer):
    """A constraint on ``J_f(x) u`` for ``u = direction(x, y)``: invariance, monotonicity, target, Lipschitz.

    ``penalty = mean_b h(J_f(x_b) u_b)`` with ``h`` given by ``kind`` (see :class:`~jvpreg.losses.JVPConstraint`);
    ``y`` comes from the batch (``target_index``/``target_key``).

    Args:
        direction: ``direction(x, y) -> u`` or a fixed tensor.
        weight: the penalty weight.
        kind, target, lipschitz, margin, power: see :class:`~jvpreg.losses.JVPConstraint`.
        **kwargs: the options of :class:`JVPRegularizer`.

    Example::

        >>> mono = ConstraintRegularizer(torch.tensor([1.0, 0, 0, 0]), weight=1.0, kind="nonneg")
        >>> trainer = Trainer(callbacks=[mono])
    """

    def __init__(self, direction: Any, weight: float, kind: str = "zero", target: Any = None,
                 lipschitz: Optional[float] = None, *, margin: float = 0.0, power: float = 1.0, **kwargs: Any):
        pen = JVPConstraint(direction, kind, target, lipschitz, margin=margin, power=power,
                            output_key=kwargs.get("output_key"))
        super().__init__(pen, weight, **kwargs)


class ParameterSensitivityRegularizer(JVPRegularizer):
    """Flatness: ``weight * E_U ||J_W f(x) U||²`` for random directions on the weights matching ``params``.

    Args:
        weight: the penalty weight.
        params, n_projections, relative, distribution, seed: see :class:`~jvpreg.losses.ParameterSensitivity`
            (names are relative to the regularized ``module``).
        **kwargs: the options of :class:`JVPRegularizer`.

    Example::

        >>> trainer = Trainer(callbacks=[ParameterSensitivityRegularizer(1e-3, params="net.layer4.*weight")])
    """

    def __init__(self, weight: float, params: Union[str, Sequence[str]] = ("*conv*weight",), n_projections: int = 1,
                 relative: bool = True, distribution: str = "gaussian", *, seed: Optional[int] = None, **kwargs: Any):
        pen = ParameterSensitivity(params, n_projections, relative, distribution, seed=seed,
                                   output_key=kwargs.get("output_key"))
        super().__init__(pen, weight, **kwargs)


class SpectralRegularizer(JVPRegularizer):
    """Spectral-norm regularization: ``weight * mean_b ||J_f(x_b) v_b||²`` with power-iteration vectors ``v_b``.

    The vectors persist across steps and are saved in the callback's checkpoint state; one power
    iteration per step comes free with the training backward (see
    :class:`~jvpreg.losses.JacobianSpectralNorm`).

    Args:
        weight: the penalty weight.
        n_iter, seed: see :class:`~jvpreg.losses.JacobianSpectralNorm`.
        **kwargs: the options of :class:`JVPRegularizer`.

    Example::

        >>> trainer = Trainer(callbacks=[SpectralRegularizer(weight=0.01)])
    """

    def __init__(self, weight: float, n_iter: int = 1, *, seed: Optional[int] = None, **kwargs: Any):
        super().__init__(JacobianSpectralNorm(n_iter, seed=seed, output_key=kwargs.get("output_key")), weight, **kwargs)
