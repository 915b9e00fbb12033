"""One PPO iteration of the learner (policy version v -> v + 1) on a batch of trajectories.

Public API::

    PPOTrainer(cfg, models, seed=0)
        .update(trajectories, step, version=None) -> dict   # every rank calls it with the SAME global batch
    micro_loss_scale(n_micro, n_global, world_size, accumulation) -> float

An iteration, for this rank's contiguous slice of the global batch:

1. collate the slice (token layout of ``worldloop.common.contracts.modeling``; images stay with their sequence);
2. without gradients, per micro-batch: proximal log-probs of the current policy (version v, at
   the actors' sampling temperature), reference log-probs, critic values; with
   ``trainer.proximal_from_first_pass`` (and no reference model, ``off_policy: cap``, no dropout)
   the proximal log-probs of the first epoch's first mini-batch are left to its own training
   forward, which runs the same weights on the same inputs before any step;
3. turn rewards r_t = reasoning + format + env (``worldloop.learner.rewards.assemble_token_rewards``, WMAct Eq. 4
   rescaling by config) at each turn's last token; with ``kl_in_reward`` the token rewards are
   ``-kl_coef * KL(prox || ref)``; advantages and returns from ``worldloop.learner.advantages``; the
   advantages are whitened over the global batch (all ranks) unless the estimator is grpo or gigpo
   (already group-normalised). The group baselines need the whole batch: every rank computes
   the per-trajectory scores of the whole batch (the KL sums are all-reduced) before slicing
   (gigpo also takes every turn's anchor, ``worldloop.learner.credit``); with
   ``observation_advantage: grounding`` the observation tokens then get the grounding advantage
   (``worldloop.learner.credit.observation_advantages``), with ``reasoning_advantage: outlook`` the
   reasoning tokens the outlook advantage (``reasoning_advantages``);
4. ``ppo_epochs`` passes over shuffled PPO mini-batches (``ppo_mini_batch_size`` trajectories
   over all ranks, one optimizer step each), each accumulated over micro-batches: decoupled PPO
   policy loss (ratio against the proximal log-probs; the off-policy weight from proximal/behaviour
   of ``trainer.off_policy``, ``worldloop.learner.offpolicy``, by default truncated at
   ``importance_weight_cap``), minus ``entropy_coef`` x entropy, plus
   ``kl_coef`` x KL(pi || ref) when the KL is not in the reward; clipped value loss for the critic.
   The policy terms are aggregated over the global mini-batch as ``trainer.loss_agg_mode`` says
   (``token-mean``: every loss token weighs the same; ``seq-mean-token-mean``: every trajectory
   weighs the same; ``seq-mean-token-sum``: a trajectory weighs its token count, averaged over
   trajectories; ``worldloop.learner.losses.aggregation_weights``): each micro-batch contributes its
   weighted sum divided by the mini-batch's normaliser, so the gradient is exactly the mini-batch's
   aggregate whatever the padding or rank split. The critic's loss is always the token mean.

Micro-batches (step 2 and 4; planned and laid out by ``worldloop.learner.microbatch``):
``trainer.packing`` true (the default) packs whole trajectories end to end into one row per
micro-batch, position ids restarting at each trajectory (Qwen2.5-VL's M-RoPE ids computed per
trajectory), no padding but the last ``pad_to_multiple`` rounding, attention kept within each
trajectory by varlen attention (learner/varlen.py: no mask, each trajectory costs its own length
squared); false keeps padded rows, each micro-batch padded to its longest.
``trainer.micro_batch_tokens`` = 0 takes ``micro_batch_size`` trajectories at a time in
mini-batch order; > 0 forms micro-batches by a token budget over the rows of the mini-batch (or,
for step 2, of the local batch), longest first: packed, first-fit decreasing on real tokens;
padded, filled while rows x longest stays within the budget; a row longer than the budget goes
alone. ``auto``: on CUDA the budget that the GPU's free memory holds after the state the first
step still allocates, by the memory model of ``worldloop.learner.memory`` (computed once, at the
first update, the smallest over ranks); on CPU ``micro_batch_size`` x the update's longest row.
Every micro-batch's length is a multiple of ``trainer.pad_to_multiple`` (auto: 128 on CUDA, 8 on
CPU), so the shapes that reach the kernels repeat from update to update; padding changes no loss
(every term is masked). The mini-batches themselves (which trajectories share an optimizer step)
do not change, nor does the loss: the share weighting above makes the accumulated gradient the
same token mean whatever the split or layout.
The number of micro-batches then varies per mini-batch, so the trainer marks DeepSpeed's
accumulation boundary itself (``set_gradient_accumulation_boundary`` on the last micro-batch;
the loss scaling keeps the engine's nominal accumulation steps, which it divides by), and with
several ranks every rank runs the same number of micro-batches per mini-batch (the most any rank
planned; a rank with fewer splits its largest ones), since ZeRO-2/3 communicate on every
backward and ZeRO-3 on every forward.

Loss mask: 1 on generated tokens, 0 on prompt/observation/image tokens (``loss_mask_for``; only
``vanilla_ppo`` widens it, as that baseline is defined).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

import torch

from worldloop.common.contracts.config import Config
from worldloop.common.contracts.algorithms import estimator_spec
from worldloop.common.contracts.modeling import build_sequence, collate
from worldloop.common.contracts.schemas import Trajectory
from worldloop.learner import advantages as adv_mod
from worldloop.learner.credit import observation_advantages, reasoning_advantages, step_group_stats, trajectory_anchors
from worldloop.learner.engine import Models, all_reduce_max, all_reduce_sum
from worldloop.learner.kernels import checkpointing_mode, pad_multiple
from worldloop.learner.memory import auto_micro_batch_tokens
from worldloop.learner.microbatch import (auto_budget, micro_slices, packed_micro_batches, packed_slices, place,
                                          rope_positions, split_micro_batches, token_budget_micro_batches)
from worldloop.learner.offpolicy import apply_correction
from worldloop.learner.losses import (aggregation_normaliser, aggregation_weights, kl_penalty, masked_mean, policy_loss,
                                      stats_floats, value_loss, weighted_sum)
from worldloop.learner.rewards import assemble_token_rewards, place_turn_rewards, turn_rewards
from worldloop.learner.vision import TowerGroups, VisionCache

log = logging.getLogger(__name__)

# stats reduced with max / min over ranks and micro-batches (everything else: token-weighted mean)
_MAX_STATS = ("iw_max", "ratio_max")
_MIN_STATS = ("iw_min", "ratio_min")




def micro_loss_scale(n_micro: float, n_global: float, world_size: int, accumulation: int) -> float:
    """Factor for a micro-batch's token-mean loss so that the accumulated gradient is the exact
    token mean over the global mini-batch: its share of the mini-batch's loss tokens, times the
    accumulation steps and ranks that DeepSpeed divides by (loss / accumulation, mean over ranks)."""
    return n_micro / max(n_global, 1.0) * world_size * accumulation


class _Acc:
    """Token-weighted means plus max/min of per-micro-batch stats (reduced over ranks at the end)."""

    def __init__(self):
        self.sum: dict[str, float] = defaultdict(float)
        self.weight: dict[str, float] = defaultdict(float)
        self.max: dict[str, float] = {}
        self.min: dict[str, float] = {}

    def add(self, prefix: str, stats: dict[str, float], weight: float) -> None:
        for k, v in stats.items():
            key = f"{prefix}{k}"
            if k in _MAX_STATS:
                self.max[key] = max(self.max.get(key, -math.inf), v)
            elif k in _MIN_STATS:
                self.min[key] = min(self.min.get(key, math.inf), v)
            elif k != "tokens":
                self.sum[key] += v * weight
                self.weight[key] += weight

    def reduce(self, models: Models) -> dict[str, float]:
        keys = sorted(self.sum)
        sums = all_reduce_sum([self.sum[k] for k in keys] + [self.weight[k] for k in keys], models.dist)
        out = {k: sums[i] / sums[len(keys) + i] if sums[len(keys) + i] > 0 else 0.0 for i, k in enumerate(keys)}
        mx = sorted(self.max)
        for k, v in zip(mx, all_reduce_max([self.max[k] for k in mx], models.dist)):
            out[k] = v
        mn = sorted(self.min)
        for k, v in zip(mn, all_reduce_max([-self.min[k] for k in mn], models.dist)):
            out[k] = -v
        return out


class _Clock:
    """Phase times without a host sync per phase: CUDA events on a GPU, summed once at the end
    (:meth:`seconds` synchronises), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = defaultdict(list)

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, name: str, start, end) -> None:
        self.spans[name].append((start, end))

    def seconds(self, name: str) -> float:
        spans = self.spans.pop(name, [])
        if not self.cuda:
            return sum(b - a for a, b in spans)
        if spans:
            torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in spans) / 1000.0


class PPOTrainer:
    def __init__(self, cfg: Config, models: Models, seed: int = 0):
        self.cfg = cfg
        self.t = cfg.trainer
        self.models = models
        self.seed = int(seed)
        self.temperature = float(cfg.actor.temperature) if cfg.actor.temperature > 0 else 1.0
        world = models.dist.world_size
        self.local_batch = self.t.train_batch_size // world
        self.local_mini = self.t.ppo_mini_batch_size // world
        self.micro = self.t.micro_batch_size
        self.micro_tokens = self.t.micro_batch_tokens
        self.device = models.dist.device
        self.pad = pad_multiple(cfg, self.device)
        self.packing = bool(self.t.packing)
        self._cuda_budget: int | None = None  # micro_batch_tokens auto on CUDA, set at the first update
        self._towers = TowerGroups() if self.t.vision_cache else None  # learner/vision.py
        self._vision: VisionCache | None = None  # this update's image features
        self.last_vision_tower_calls: int | None = None
        # the policy's training forward computes what its no-grad one does (_proximal_in_training)
        self._dropout_free = not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in models.policy.module.modules()) \
            and not float(getattr(getattr(models.policy_hf, "config", None), "attention_dropout", 0.0) or 0.0)
        self._grad_norm_now: dict[str, float] = {}
        if not self.spec.reads_values and models.critic is not None:
            log.warning("trainer.estimator=%s does not read values: the critic (trainer.use_critic) is trained for nothing",
                        self.t.estimator)
        if self.spec.reads_values and models.critic is None:
            log.warning("trainer.use_critic=false with %s: values are 0, advantages are Monte-Carlo returns", self.t.estimator)

    @property
    def spec(self):
        """What the configured estimator needs (common/contracts/algorithms.py), asked at each use."""
        return estimator_spec(self.t.estimator)

    # ------------------------------------------------------------------ helpers

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _local_rows(self) -> range:
        r = self.models.dist.rank
        return range(r * self.local_batch, (r + 1) * self.local_batch)

    def _chunks(self, rows: list[int], size: int) -> list[list[int]]:
        return [rows[s : s + size] for s in range(0, len(rows), size)]

    def _budget(self, lengths: list[int]) -> int:
        """The token budget of this update's micro-batches; 0 = a fixed count (module docstring)."""
        if self.micro_tokens != "auto":
            return int(self.micro_tokens)
        if self.device.type != "cuda":
            return auto_budget(lengths, self.micro, self.pad)
        if self._cuda_budget is None:
            mine = auto_micro_batch_tokens(self.models, self.t.logprob_chunk_tokens, checkpointing=checkpointing_mode(self.t),
                                           multiple=self.pad, device=self.device)
            self._cuda_budget = int(-all_reduce_max([-float(mine)], self.models.dist)[0])
            log.info("trainer.micro_batch_tokens auto: %d token slots per micro-batch", self._cuda_budget)
        return self._cuda_budget

    def _plan(self, groups: list[list[int]], lengths: list[int]) -> list[list[list[int]]]:
        """The micro-batches of each group of rows (a mini-batch, or the local batch): fixed count
        or token budget, packed or padded (module docstring); the same number per group on every rank."""
        budget = self._budget(lengths)
        if budget <= 0:
            return [self._chunks(g, self.micro) for g in groups]
        plan = packed_micro_batches if self.packing else token_budget_micro_batches
        plans = [plan(g, lengths, budget, self.pad) for g in groups]
        most = all_reduce_max([float(len(p)) for p in plans], self.models.dist)
        return [split_micro_batches(p, lengths, int(n), self.pad, self.packing) for p, n in zip(plans, most)]

    def _slices(self, batch: dict, rows: list[int], image_counts: list[int], lengths: list[int]) -> dict:
        """One micro-batch of ``rows``: one packed row, or padded rows (``trainer.packing``)."""
        if self.packing:
            mb = packed_slices(batch, rows, image_counts, lengths, self.pad)
        else:
            mb = micro_slices(batch, rows, image_counts, self.pad)
        if self._vision is not None and "image_ids" in mb:
            mb["vision_cache"] = self._vision
        return mb

    @staticmethod
    def _count_slots(mb: dict, timing: dict) -> None:
        timing["slots"] += float(mb["attention_mask"].numel())
        timing["real"] += float(mb["attention_mask"].sum())

    @staticmethod
    def _set_boundary(engine, last: bool) -> None:
        """Mark whether the coming backward ends the mini-batch (DeepSpeed reduces and steps then)."""
        engine.set_gradient_accumulation_boundary(bool(last))

    @torch.no_grad()
    def _precompute(self, batch: dict, image_counts: list[int], lengths: list[int], timing: dict,
                    first: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Proximal / reference log-probs and old values of every local row, [B, L] on CPU; the
        proximal log-probs of the rows in ``first`` are left to the first training pass."""
        shape = batch["input_ids"].shape
        out = {"old_logprobs": torch.zeros(shape), "ref_logprobs": torch.zeros(shape), "old_values": torch.zeros(shape)}
        every = list(range(shape[0]))
        others = self.models.reference is not None or self.models.critic is not None
        passes = [(every, True, others)]  # (rows, proximal, reference and critic)
        if first is not None:  # the reference and critic on every row first (each micro-batch meets new
            # images: a ZeRO-3 tower is called as often on every rank), then the proximal on the others
            skip = set(first)
            rest = [x for x in every if x not in skip]
            passes = ([(every, False, True)] if others else []) + ([(rest, True, False)] if rest else [])
        for rows_of_pass, proximal, with_others in passes:
            for rows in self._plan([rows_of_pass], lengths)[0]:
                mb = self._slices(batch, rows, image_counts, lengths)
                self._count_slots(mb, timing)
                if proximal:
                    lp, _ = self.models.policy.module(mb, temperature=self.temperature)
                    place(out["old_logprobs"], mb, rows, lp)
                if with_others and self.models.reference is not None:
                    ref, _ = self.models.reference(mb, temperature=self.temperature)
                    place(out["ref_logprobs"], mb, rows, ref)
                if with_others and self.models.critic is not None:
                    place(out["old_values"], mb, rows, self.models.critic.module(mb))
        return out

    def _proximal_in_training(self) -> bool:
        """Whether the first mini-batch's proximal log-probs may come from its training forward
        (``trainer.proximal_from_first_pass``): nothing reads them before training (no reference
        model, whose KL takes them; ``off_policy: cap``, whose weights policy_loss computes per micro-batch)
        and the training forward is the no-grad one (no dropout)."""
        return (self.t.proximal_from_first_pass and self.models.reference is None and self.t.off_policy == "cap"
                and self._dropout_free)

    def _kl(self, logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        return kl_penalty(logprobs, ref, kind=self.t.kl_estimator)

    def _grpo_token_rewards(self, all_trajs: list[Trajectory], local_sums: torch.Tensor, length: int) -> tuple[dict, torch.Tensor]:
        """Masks of the WHOLE batch (no images decoded) and each row's token-reward sum placed on
        its last generated token, so grpo sees every group member's score on every rank."""
        layouts = [build_sequence(t) for t in all_trajs]
        width = max(length, max(len(x) for x in layouts))
        resp = torch.zeros(len(layouts), width)
        end = torch.zeros(len(layouts), width)
        for i, x in enumerate(layouts):
            resp[i, : len(x)] = x.response_mask
            end[i, : len(x)] = x.turn_end_mask
        sums = torch.zeros(len(layouts), dtype=torch.float64)
        rows = self._local_rows()
        sums[rows.start : rows.stop] = local_sums.double()
        sums = torch.tensor(all_reduce_sum(sums.tolist(), self.models.dist))
        tok = torch.zeros(len(layouts), width)
        last = torch.tensor([int(x.turn_spans[-1][1]) - 1 for x in layouts])
        tok[torch.arange(len(layouts)), last] = sums.float()
        return {"response_mask": resp, "turn_end_mask": end}, tok

    def _whiten(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.models.dist.world_size == 1:
            return adv_mod.whiten(adv, mask)
        m = mask != 0
        x = torch.where(m, adv.double(), 0.0)
        s, ss, n = all_reduce_sum([float(x.sum()), float((x * x).sum()), float(m.sum())], self.models.dist)
        mean = s / max(n, 1)
        var = (ss - n * mean * mean) / max(n - 1, 1) if n >= 2 else 0.0
        out = (adv.double() - mean) / math.sqrt(max(var, 0.0) + 1e-8)
        return torch.where(m, out, 0.0).float()

    # ------------------------------------------------------------------ the iteration

    def update(self, trajectories: list[Trajectory], step: int, version: int | None = None) -> dict:
        """One PPO iteration on the global batch ``trajectories`` from policy ``version`` (the weights'
        version, for the mismatch over the tokens they sampled); returns stats (same on every rank)."""
        timing = defaultdict(float)
        rows = self._local_rows()
        local = trajectories[rows.start : rows.stop]
        batch, image_counts, lengths = self._collate(local)
        if self._towers is not None:
            self._towers.prepare(self._vision_owners())  # once: the same gathers on every rank
            self._vision = VisionCache(self._towers)
        try:
            return self._update(batch, image_counts, lengths, trajectories, local, step, version, timing)
        finally:
            self._vision = None  # the features are this update's only

    def _vision_owners(self) -> list[torch.nn.Module]:
        """The modules whose forward runs a vision tower (common/contracts/logprobs.py ``owner``): the
        policy's and the reference's inner models, the critic's backbone."""
        m = self.models
        found = [getattr(getattr(x, "hf", None), "model", None) for x in (m.policy.module, m.reference)]
        found.append(m.critic.module.backbone if m.critic is not None else None)
        return [x for x in found if isinstance(x, torch.nn.Module)]

    def _update(self, batch: dict, image_counts: list[int], lengths: list[int], trajectories: list[Trajectory],
                local: list[Trajectory], step: int, version: int | None, timing: dict) -> dict:
        self._sync()
        t0 = time.perf_counter()
        orders = self._orders(len(lengths), step)
        first = self._chunks(orders[0], self.local_mini)[0] if self._proximal_in_training() else None
        pre = self._precompute(batch, image_counts, lengths, timing, first)
        self._sync()
        timing["forward"] += time.perf_counter() - t0
        raw_adv, kl_tok, credit = self._advantages(batch, pre, trajectories, local)
        if first is None:
            mismatch = apply_correction(batch, self.t, version, self.models.dist)  # batch["is_weight"] unless cap
        acc = _Acc()
        grad_norms: dict[str, list[float]] = defaultdict(list)
        clock = _Clock(self.device)
        n_micro_batches = self._ppo_epochs(batch, image_counts, lengths, orders, first is not None, acc, grad_norms,
                                           timing, clock)
        if first is not None:  # the first mini-batch's proximal log-probs are in the batch now
            mismatch = apply_correction(batch, self.t, version, self.models.dist)
        timing["forward"] += clock.seconds("forward")  # one sync on CUDA, after the training passes
        timing["backward"] += clock.seconds("backward")
        stats = acc.reduce(self.models)
        self._add_batch_stats(stats, raw_adv, batch["returns"], batch["loss_mask"], kl_tok, pre, grad_norms)
        tokens = all_reduce_sum([float(batch["attention_mask"].sum()), float(batch["response_mask"].sum())], self.models.dist)
        slots, real = all_reduce_sum([timing["slots"], timing["real"]], self.models.dist)
        stats.update(tokens=tokens[0], response_tokens=tokens[1], forward_seconds=timing["forward"],
                     backward_seconds=timing["backward"], micro_batches=n_micro_batches,
                     padding_fraction=1.0 - real / slots if slots > 0 else 0.0)
        stats["mismatch"] = mismatch
        if credit:
            stats["credit"] = credit
        # the vision tower's calls this rank made through the cache in this update (learner/vision.py)
        self.last_vision_tower_calls = self._vision.tower_calls if self._vision is not None else None
        return stats

    def _collate(self, local: list[Trajectory]) -> tuple[dict, list[int], list[int]]:
        """This rank's rows collated (length a multiple of ``self.pad``), their image counts and
        lengths; ``loss_mask`` and ``logprob_mask`` (the LM head runs on loss tokens only) added."""
        layouts = [build_sequence(x) for x in local]
        batch = collate(layouts, self.models.codec, pad_to_multiple=self.pad)
        lengths = [int(n) for n in batch["attention_mask"].sum(1).tolist()]
        mask = adv_mod.loss_mask_for(self.t.estimator, batch["response_mask"], batch["attention_mask"]).float()
        batch["loss_mask"] = batch["logprob_mask"] = mask
        if self.packing:  # M-RoPE ids per trajectory, from the padded rows (learner/microbatch.py)
            rope = rope_positions(self.models.policy_hf, batch)
            if rope is not None:
                batch["rope_positions"] = rope
        return batch, [len(x.images) for x in layouts], lengths

    def _advantages(self, batch: dict, pre: dict, trajectories: list[Trajectory], local: list[Trajectory]):
        """Rewards, the KL to the reference, advantages and returns of the local rows, into ``batch``
        (with ``pre`` and the aggregation weights); returns (advantages before whitening, per-token KL,
        the per-turn credit stats of :meth:`_credit`)."""
        t, models = self.t, self.models
        resp, mask = batch["response_mask"], batch["loss_mask"]
        rewards, kl_tok, token_rewards = assemble_token_rewards(
            local, batch["turn_end_mask"], mask, pre["old_logprobs"],
            pre["ref_logprobs"] if models.reference is not None else None, wmact_rescale=t.wmact_rescale,
            kl_coef=t.kl_coef, kl_in_reward=t.kl_in_reward, kl_estimator=t.kl_estimator)
        common = dict(adv_mod.advantage_kwargs(t))
        if self.spec.grouped:
            rows, length = self._local_rows(), mask.shape[1]
            full, tok = self._grpo_token_rewards(trajectories, token_rewards.sum(1), length)
            full_rewards = place_turn_rewards(full["turn_end_mask"], [turn_rewards(x, wmact_rescale=t.wmact_rescale) for x in trajectories])
            adv_all, ret_all = adv_mod.compute_advantages(
                t.estimator, response_mask=full["response_mask"], turn_end_mask=full["turn_end_mask"],
                turn_rewards=full_rewards, token_rewards=tok, group_ids=[x.group_id for x in trajectories],
                **self._group_inputs(trajectories), **common)
            advantages = adv_all[rows.start : rows.stop, :length] * resp
            returns = ret_all[rows.start : rows.stop, :length] * resp
        else:
            advantages, returns = adv_mod.compute_advantages(
                t.estimator, values=pre["old_values"], response_mask=resp, turn_end_mask=batch["turn_end_mask"],
                turn_rewards=rewards, token_rewards=token_rewards, attention_mask=batch["attention_mask"], **common)
        whitened = self._whiten(advantages, mask) if t.whiten_advantages and not self.spec.grouped else advantages
        advantages, whitened, credit = self._credit(trajectories, advantages, whitened, mask)
        batch.update(pre)
        batch.update(advantages=whitened, returns=returns, loss_weight=aggregation_weights(mask, t.loss_agg_mode))
        return advantages, kl_tok, credit

    def _orders(self, n_rows: int, step: int) -> list[list[int]]:
        """Each PPO epoch's shuffled order of this rank's rows."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + self.models.dist.rank)
        return [torch.randperm(n_rows, generator=gen).tolist() for _ in range(self.t.ppo_epochs)]

    def _ppo_epochs(self, batch: dict, image_counts: list[int], lengths: list[int], orders: list[list[int]],
                    fill_first: bool, acc: _Acc, grad_norms: dict[str, list[float]], timing: dict, clock: "_Clock") -> int:
        """``ppo_epochs`` passes over shuffled mini-batches, one optimizer step each; with
        ``fill_first`` the first mini-batch's forwards give its proximal log-probs (into ``batch``);
        returns the number of micro-batches trained."""
        t, models = self.t, self.models
        mask = batch["loss_mask"]
        n_micro_batches = 0
        for epoch, order in enumerate(orders):
            minis = self._chunks(order, self.local_mini)
            for k, (mini, micros) in enumerate(zip(minis, self._plan(minis, lengths))):
                n_global, n_tokens = all_reduce_sum([aggregation_normaliser(mask[mini], t.loss_agg_mode),
                                                     float(mask[mini].sum())], models.dist)
                for i, micro in enumerate(micros):
                    mb = self._slices(batch, micro, image_counts, lengths)
                    self._count_slots(mb, timing)
                    n_micro = float(mb["loss_mask"].sum())  # a host tensor: no device sync
                    proximal = (batch["old_logprobs"], micro) if fill_first and epoch == k == 0 else None
                    self._train_micro(mb, n_micro, n_global, n_tokens, acc, clock, last=i == len(micros) - 1,
                                      proximal=proximal)
                n_micro_batches += len(micros)
                self._boundary(grad_norms)
        return n_micro_batches

    # ------------------------------------------------------------------ per-turn credit (learner/credit.py)

    def _group_inputs(self, trajectories: list[Trajectory]) -> dict:
        """The group estimator's per-turn inputs of the whole batch: gigpo's anchors."""
        return {"anchors": trajectory_anchors(trajectories)} if self.spec.step_groups else {}

    def _credit(self, trajectories: list[Trajectory], raw_adv: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """With ``observation_advantage: grounding`` the local rows' observation tokens get the
        grounding advantage in place of the task advantage (before and after whitening alike), with
        ``reasoning_advantage: outlook`` their reasoning tokens the outlook advantage; the stats of
        gigpo's step groups and of those advantages."""
        t, out = self.t, {}
        if self.spec.step_groups:
            out["step_groups"] = step_group_stats(trajectories)
        spans = [("observation", observation_advantages, t.observation_advantage == "grounding", t.observation_advantage_coef),
                 ("reasoning", reasoning_advantages, t.reasoning_advantage == "outlook", t.reasoning_advantage_coef)]
        for name, advantages_of, wanted, coef in spans:
            if not wanted:
                continue
            span, values, st = advantages_of(trajectories, self._local_rows(), self.models.codec, tuple(mask.shape),
                                             baseline=t.observation_baseline, coef=coef)
            on = (span > 0) & (mask > 0)
            raw_adv, advantages = torch.where(on, values, raw_adv), torch.where(on, values, advantages)
            out[name] = {"turns": st["turns"], "tokens": all_reduce_sum([float(on.sum())], self.models.dist)[0]}
        return raw_adv, advantages, out

    def _train_micro(self, mb: dict, n_micro: float, n_global: float, n_tokens: float, acc: _Acc, clock: "_Clock",
                     last: bool, proximal: tuple | None = None) -> None:
        """One micro-batch. The policy terms are weighted sums over ``loss_weight`` divided by the
        mini-batch's normaliser ``n_global`` (``trainer.loss_agg_mode``); the critic's is its token
        mean weighted by the micro-batch's share ``n_micro`` of the mini-batch's ``n_tokens``. One
        host sync of its own (the stats, read together at the end); tensors reach the device
        through pinned memory without waiting. ``proximal`` (the batch's ``old_logprobs`` and the
        micro-batch's rows): this forward, before any step, gives the proximal log-probs, written there."""
        t, models = self.t, self.models
        on = self._on_device
        m, w = on(mb["loss_mask"]), on(mb["loss_weight"])
        ranks_acc = models.dist.world_size * models.policy.gradient_accumulation_steps()
        t0 = clock.mark()
        self._set_boundary(models.policy, last)
        # entropy_coef 0 with Liger: the fused head, no entropy and no full logits (learner/kernels.py)
        want_entropy = bool(t.entropy_coef) or not models.liger
        lp, ent = models.policy(mb, temperature=self.temperature, return_entropy=want_entropy)
        if proximal is not None:
            mb["old_logprobs"] = lp.detach()
            place(proximal[0], mb, proximal[1], mb["old_logprobs"])
        pl, pst = policy_loss(lp, on(mb["old_logprobs"]), on(mb["behaviour_logprobs"]), on(mb["advantages"]), m,
                              clip_ratio=t.clip_ratio, iw_cap=t.importance_weight_cap, token_weights=w,
                              is_weights=on(mb["is_weight"]) if "is_weight" in mb else None, as_tensors=True)
        if ent is not None:
            pst["entropy"] = masked_mean(ent.detach(), m)
        loss = pl - t.entropy_coef * weighted_sum(ent, w, m) if t.entropy_coef else pl
        if not t.kl_in_reward and models.reference is not None and t.kl_coef > 0:
            kl = self._kl(lp, on(mb["ref_logprobs"]))
            pst["kl_loss"] = masked_mean(kl.detach(), m)
            loss = loss + t.kl_coef * weighted_sum(kl, w, m)
        self._optimise("policy", models.policy, loss * (ranks_acc / max(n_global, 1.0)), t0, clock)
        vst: dict = {}
        if models.critic is not None:
            t0 = clock.mark()
            self._set_boundary(models.critic, last)
            values = models.critic(mb)
            vl, vst = value_loss(values, on(mb["old_values"]), on(mb["returns"]), m, value_clip=t.value_clip,
                                 as_tensors=True)
            share = micro_loss_scale(n_micro, n_tokens, models.dist.world_size, models.critic.gradient_accumulation_steps())
            self._optimise("critic", models.critic, vl * share, t0, clock)
        pst, vst = stats_floats(pst, vst)  # the one host sync
        acc.add("policy_", pst, n_micro)
        if vst:
            acc.add("value_", vst, n_micro)

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and x.device.type == "cpu":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def _optimise(self, name: str, engine, loss: torch.Tensor, t0, clock: "_Clock") -> None:
        """Backward + (accumulating) optimizer step; forward time is counted from ``t0``."""
        t1 = clock.mark()
        engine.backward(loss)
        self._own_grad_norm(name, engine)
        engine.step()
        clock.add("forward", t0, t1)
        clock.add("backward", t1, clock.mark())

    def _own_grad_norm(self, name: str, engine) -> None:
        """ZeRO stage 0 in fp32 clips without keeping the norm: measure it before the step."""
        if self.models.zero_stage == 0 and not self.models.bf16 and engine.is_gradient_accumulation_boundary():
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            self._grad_norm_now[name] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0

    def _boundary(self, grad_norms: dict[str, list[float]]) -> None:
        for name, engine in (("policy", self.models.policy), ("critic", self.models.critic)):
            if engine is None:
                continue
            g = self._grad_norm_now.pop(name, None)
            g = engine.get_global_grad_norm() if g is None else g
            if g is not None:
                grad_norms[name].append(float(g))

    def _add_batch_stats(self, stats: dict, adv: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                         kl_tok: torch.Tensor, pre: dict, grad_norms: dict) -> None:
        m = mask > 0
        d = self.models.dist
        a = adv[m].double()
        s, ss, n, kl, ret = all_reduce_sum([float(a.sum()), float((a * a).sum()), float(m.sum()),
                                           float(kl_tok[m].sum()), float(returns[m].sum())], d)
        mean = s / max(n, 1)
        amax, nmin = all_reduce_max([float(a.max()) if a.numel() else 0.0, -float(a.min()) if a.numel() else 0.0], d)
        stats.update(
            advantage_mean=mean, advantage_std=math.sqrt(max(ss / max(n, 1) - mean * mean, 0.0)),
            advantage_max=amax, advantage_min=-nmin, kl=kl / max(n, 1), return_mean=ret / max(n, 1),
        )
        for name, vals in grad_norms.items():
            stats[f"grad_norm_{name}"] = sum(vals) / len(vals)
