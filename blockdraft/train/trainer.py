"""`blockdraft train`: the open DFlash training recipe, nanoGPT style.

One flat loop: a batch of (prompt, regenerated answer) sequences goes through the
frozen target under no-grad, capturing the context features (it stops at the deepest
captured layer unless soft labels need its logits); random anchors inside the answers
open blocks; the drafter denoises every block in one masked forward; a chunked LM head
(the target's, frozen) gives the weighted cross-entropy against the answer tokens, the
target's own distribution, or a mix of both. AdamW, warmup then cosine or
warmup-stable-decay, optional gradient clipping. Mixed precision: the target runs in its
own dtype (bf16 on CUDA), the drafter keeps fp32 weights and runs under autocast; step
statistics stay on the device until a log step. Distributed data parallel is switched on
by torchrun's environment alone (gloo on CPU, NCCL on CUDA). Every random choice is a
function of (seed, step, rank), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .. import drafters
from ..draft_config import loss_decay_gamma
from ..errors import BlockdraftError
from ..models import eos_token_ids, load_target
from .blocks import build_blocks
from .config import TrainConfig, lr_at
from .features import FP16_MAX, TEACHER_TOPK, sequence_key, top_tokens
from . import checkpoints, evaluate
from .init import init_from_target
from .loss import frequent_tokens, previous_tokens, weighted_loss
from .samples import trained_ids, training_samples


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, position_dir: str | Path | None = None):
        """`resume`: continue from OUT/checkpoint (bit for bit where it holds the optimizer state;
        from a position without it, the optimizer's moments start anew). `position_dir`: at every
        checkpoint also write the weights (in fp16) and the schedule position there, without the
        optimizer state (a folder small enough to commit; `blockdraft train --resume-from` continues it)."""
        self.cfg = cfg
        self.position_dir = Path(position_dir) if position_dir else None
        self.stopped_by: int | None = None  # the signal that stopped `run` early, if one did
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.out = Path(cfg.out)
        if cfg.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        elif cfg.dtype in ("float32", "bfloat16", "float16"):
            self.dtype = getattr(torch, cfg.dtype)
        else:
            raise BlockdraftError(f"--dtype must be auto, float32, bfloat16 or float16, not {cfg.dtype!r}")
        # The drafter keeps fp32 weights; a lower-precision target runs it under autocast.
        self.autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        from ..models.default import DEFAULT_MASK_TOKEN_ID, default_target_dir

        target_dir = Path(cfg.target) if cfg.target else default_target_dir()
        self.target = load_target(target_dir, self.device, self.dtype).requires_grad_(False)
        self.stop_token_ids = tuple(eos_token_ids(target_dir))
        if cfg.mask_token_id is None:
            cfg.mask_token_id = DEFAULT_MASK_TOKEN_ID
        self.kind = drafters.kind(cfg.arch)
        self.gamma = loss_decay_gamma(cfg.block_size) if cfg.gamma is None else (cfg.gamma or None)
        if cfg.position_weights not in ("decay", "dpace"):
            raise BlockdraftError(f"--position-weights must be decay or dpace, not {cfg.position_weights!r}")
        if not 0 < cfg.dpace_alpha <= 1:
            raise BlockdraftError(f"--dpace-alpha must be in (0, 1], not {cfg.dpace_alpha}")
        self.dpace_alpha = cfg.dpace_alpha if cfg.position_weights == "dpace" else None
        if cfg.draft_layout not in ("mask", "anchor"):
            raise BlockdraftError(f"--draft-layout must be mask or anchor, not {cfg.draft_layout!r}")
        if cfg.draft_layout == "anchor" and cfg.arch != "dflash":
            raise BlockdraftError(
                f"--draft-layout anchor is a DFlash drafter's layout (DSpark's); the {cfg.arch} drafter has its own"
            )
        self.shift = int(cfg.draft_layout == "anchor")  # a label's position after its block slot's
        if cfg.epochs and cfg.folder_samples is None and resume and (self.out / "checkpoint" / "state.json").is_file():
            saved = json.loads((self.out / "checkpoint" / "state.json").read_text())["config"]
            cfg.folder_samples = saved.get("folder_samples")  # the samples the run started with
        self.samples = self._load_samples()
        if cfg.epochs:  # fixed at the start: the samples there are now, the steps that cover them
            if cfg.folder_samples is None:
                cfg.folder_samples = self.folder_counts
            cfg.max_steps = math.ceil(cfg.epochs * len(self.samples) / (cfg.batch_size * self.world))
        self._orders: dict[int, list[int]] = {}
        self._native_step = None  # the target's fused step for features, False where it does not run
        self.step = 0
        self.tokens_seen = 0  # sequence tokens through the target, all processes
        self.elapsed, self._t0 = 0.0, time.perf_counter()  # wall seconds of earlier processes (resume)
        torch.manual_seed(cfg.seed)
        vocab = min(cfg.draft_vocab, self.target.config.vocab_size) if cfg.draft_vocab else None
        self.drafter = self.kind.build(self.target.config, cfg, vocab).to(self.device)
        self.drafter.reset_parameters()
        if cfg.init != "random":
            init_from_target(self.drafter, self.target, cfg.init, self.kind.init_layers)
        resuming = resume and (self.out / "checkpoint" / "state.json").is_file()
        if cfg.init_from and not resuming:  # (a checkpoint replaces the warm start's weights)
            self._init_from_folder(Path(cfg.init_from))
        if cfg.draft_vocab and not cfg.init_from and not resuming:  # a warm start keeps its folder's vocabulary
            self.drafter.set_draft_vocab(self.frequent_tokens())
        self.features = None
        if cfg.feature_cache:
            from .features import FeatureCache

            if not cfg.feature_cache_reserve >= 0:
                raise BlockdraftError(f"--feature-cache-reserve must be >= 0 GiB, not {cfg.feature_cache_reserve}")
            self.features = FeatureCache(
                cfg.feature_cache,
                self.target,
                self.drafter.config.target_layer_ids,
                self.rank,
                dtype=cfg.feature_dtype,
                reserve=int(cfg.feature_cache_reserve * 2**30),
            )
            # the samples this run will see (all of them from its second epoch on)
            seen = min(len(self.samples), cfg.max_steps * cfg.batch_size * self.world)
            order = range(len(self.samples)) if seen == len(self.samples) else self.epoch_order(0)[:seen]
            soft = cfg.distill > 0 and self.kind.soft_labels  # the top tokens are stored too
            note = self.features.check_space(
                [self.samples[i][0] for i in order], answer_starts=[self.samples[i][1] for i in order] if soft else None
            )
            if note and self.rank == 0:
                print(f"train: {note}", file=sys.stderr)
        # fused: one kernel over all parameters (on a CPU 10 ms a step for a 26M-parameter drafter,
        # against 47 ms for the per-parameter loop: ~6% of a step that reads its features from the cache)
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay,
            fused=self.device.type in ("cpu", "cuda"),
        )
        if resuming:
            self._load_checkpoint()  # (its draft vocabulary, perhaps widened)
        self._map_draft_vocab()
        self.model = self.drafter
        if self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.drafter)

    def frequent_tokens(self, keep=()) -> list[int]:
        """The draft vocabulary the samples give (`loss.frequent_tokens`; `keep` first)."""
        return frequent_tokens(self.samples, self.drafter.draft_vocab.numel(), self.target.config.vocab_size, keep)

    def _map_draft_vocab(self):
        """`to_draft`: target id -> draft-vocabulary index (-1 outside it); None without one."""
        self.to_draft = None
        if self.cfg.draft_vocab:
            self.to_draft = torch.full((self.target.config.vocab_size,), -1, dtype=torch.long, device=self.device)
            self.to_draft[self.drafter.draft_vocab] = torch.arange(self.drafter.draft_vocab.numel(), device=self.device)

    # ---- data ------------------------------------------------------------------------

    def _load_samples(self):
        cfg = self.cfg
        train, valid, self.folder_counts, _ = training_samples(
            cfg.data, cfg.max_seq_len, cfg.folder_samples, cfg.limit_samples, trained_ids(cfg.skip_trained_by)
        )
        if not train:
            raise BlockdraftError(
                f"{cfg.data}: no training samples"
                + (f" that {cfg.skip_trained_by} did not train on" if cfg.skip_trained_by else "")
            )
        self.valid = [t[:3] for t in valid]
        return [t[:3] for t in train]

    def epoch_order(self, epoch: int) -> list[int]:
        """Sample order of an epoch: a permutation from (seed, epoch), then sorted by length
        within windows of 16 steps so a batch's sequences need little padding."""
        if epoch not in self._orders:
            n = len(self.samples)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 1000003 + epoch)).tolist()
            window = 16 * self.cfg.batch_size * self.world
            self._orders = {
                epoch: [
                    i
                    for w in range(0, n, window)
                    for i in sorted(perm[w : w + window], key=lambda i: len(self.samples[i][0]))
                ]
            }
        return self._orders[epoch]

    def batch_indices(self, step: int) -> list[int]:
        """This process's sequences at `step`."""
        n, per_step = len(self.samples), self.cfg.batch_size * self.world
        out = []
        for j in range(per_step):
            epoch, pos = divmod(step * per_step + j, n)
            out.append(self.epoch_order(epoch)[pos])
        return out[self.rank :: self.world]

    # ---- one step --------------------------------------------------------------------

    def batch_at(self, step: int):
        """This process's blocks at `step` (anchors drawn from a generator seeded by step and rank)."""
        cfg = self.cfg
        idx = self.batch_indices(step)
        gen = torch.Generator().manual_seed((cfg.seed * 7919 + step) * 131 + self.rank)
        return build_blocks(
            [self.samples[i][0] for i in idx],
            [self.samples[i][1] for i in idx],
            block_size=cfg.block_size,
            num_anchors=cfg.num_anchors,
            mask_token_id=cfg.mask_token_id,
            gamma=self.gamma,
            generator=gen,
            anchor_mode=cfg.anchor_mode,
            shift=self.shift,
        )

    def train_step(self) -> dict:
        """One optimizer step. The record's statistics are device tensors (no host sync here);
        `host_record` turns them into numbers when a record is logged."""
        cfg = self.cfg
        batch = self.batch_at(self.step)
        dev = self.device
        with self.autocast:
            hidden, teacher = self.block_hidden(batch)
            loss, correct, count = weighted_loss(
                hidden,
                self.drafter.head_weight(self.target.lm_head.weight),
                batch.labels.to(dev),
                batch.weights.to(dev),
                batch.offsets.to(dev),
                cfg.block_size,
                cfg.lm_head_chunk,
                self.to_draft,
                teacher,
                cfg.distill,
                self.markov_inputs(batch),
                self.dpace_alpha,
            )
        lr = lr_at(cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().norm() for p in self.drafter.parameters() if p.grad is not None])
            )
        self.optimizer.step()
        self.step += 1
        return {
            "step": self.step,
            "loss": loss.detach(),
            "lr": lr,
            "grad_norm": grad_norm.detach(),
            "correct": correct,
            "count": count,
            "tokens": int(batch.lengths.sum()),
        }

    def markov_inputs(self, batch):
        """(the drafter's Markov head, the token before each block position) or None."""
        head = getattr(self.drafter, "markov_head", None)
        return None if head is None else (head, previous_tokens(batch).to(self.device))

    @staticmethod
    def host_record(record: dict) -> dict:
        """A step record with its device statistics as plain numbers (one host sync)."""
        out = {k: v for k, v in record.items() if k not in ("correct", "count")}
        out["loss"], out["grad_norm"] = float(record["loss"]), float(record["grad_norm"])
        correct, count = record["correct"].cpu().tolist(), record["count"].cpu().tolist()
        # per block slot that drafts (a slot with no label in this layout has a count of 0)
        out["acc"] = [round(c / t, 4) for c, t in zip(correct, count, strict=False) if t]
        return out

    def block_hidden(self, batch, labels: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The drafter's hidden states for every block of a batch, in one masked forward,
        conditioned on the target's features captured under no-grad; and, with soft labels, the
        target's TEACHER_TOPK likeliest tokens (ids, log-probabilities [N, A*B, k]) at the
        position that predicts each block position (else, or without `labels`, None). With a
        feature cache both are read back where stored, and computed (and stored, rounded as
        stored) for the sequences that miss."""
        dev = self.device
        tokens = batch.tokens.to(dev)
        n, width = tokens.shape
        teacher = None
        with torch.no_grad():
            positions = torch.arange(width, device=dev).expand(n, -1)
            soft = labels and self.cfg.distill > 0 and self.kind.soft_labels
            layers = tuple(self.drafter.config.target_layer_ids)
            lengths = batch.lengths.tolist()
            keys = no_top = None
            if self.features is None:
                compute, no_top = list(range(n)), list(range(n))
                features = top_ids = top_logp = None
            else:  # read back what is cached; compute, store and round as stored the rest
                keys = [sequence_key(batch.tokens[i, : lengths[i]].tolist()) for i in range(n)]
                features, missing = self.features.get(keys, width, dev, self.dtype)
                compute = missing
                if soft:
                    top_ids, top_logp, no_top = self.features.get_teacher(keys, width, dev)
                    compute = sorted(set(compute) | set(no_top))
            if soft and no_top is not None and features is None:
                top_ids = torch.full((n, width, TEACHER_TOPK), -1, dtype=torch.long, device=dev)
                top_logp = torch.zeros(n, width, TEACHER_TOPK, device=dev)
            if compute:
                full = soft and bool(no_top)  # the top tokens need the target's last layer and head
                rows = torch.tensor(compute, device=dev)
                final, computed = self.target_forward(tokens[rows], positions[rows], layers, full)
                if features is None:
                    features = computed
                elif missing:
                    got = [compute.index(i) for i in missing]
                    self.features.put([keys[i] for i in missing], computed[got], [lengths[i] for i in missing])
                    features[torch.tensor(missing, device=dev)] = self.features.round(computed[got]).to(features)
                for j, i in enumerate(compute):
                    if not soft or i not in no_top:
                        continue
                    start, stop = max(0, int(batch.starts[i]) - 1), lengths[i] - 1  # predicting the answer
                    ids, logp = top_tokens(self.target.logits(final[j, start:stop]))
                    logp = logp.clamp(min=-FP16_MAX).half().float()  # as the cache stores it
                    top_ids[i, start:stop, : ids.shape[-1]], top_logp[i, start:stop, : ids.shape[-1]] = ids, logp
                    if keys is not None:
                        self.features.put_teacher(keys[i], ids, logp, start)
            if soft:  # the label at position p is predicted by the target at p - 1
                before = (batch.label_positions.to(dev) - 1).clamp(min=0, max=width - 1)
                at = torch.arange(n, device=dev)[:, None]
                teacher = (top_ids[at, before], top_logp[at, before])
        return self.kind.train_hidden(self.model, self.target, batch, tokens, features, positions), teacher

    def target_forward(self, tokens, positions, layers, full: bool):
        """The frozen target over whole sequences (right-padded): (its final hidden states if `full`,
        else None; its features at `layers`). Through the fused native step where it runs (a bf16
        target on an AVX512-BF16 CPU: the same numbers the decode loop's target gives the drafter,
        each row's bit for bit what it gets alone, and ~1.6x faster than the eager forward), else
        the eager forward without a cache."""
        if self._native_step is None:
            from ..models import native_step

            fits = native_step.unsupported(self.target) is None
            self._native_step = native_step.step_for(self.target) if fits else False
        if not self._native_step:
            return self.target(tokens, positions, capture=layers, features_only=not full)
        cache = self.target.new_cache(tokens.shape[0], tokens.shape[1])
        return self._native_step(tokens, positions, cache, capture=layers, features_only=not full)

    # ---- evaluation ------------------------------------------------------------------
    evaluate_tau = evaluate.decode_tau  # τ in the real decode loop on held-out prompts
    evaluate_blocks = evaluate.teacher_forced  # teacher-forced block acceptance, per-position CE and accuracy

    # ---- checkpoints (`train.checkpoints`) ---------------------------------------------
    SKIP_ON_RESUME = checkpoints.SKIP_ON_RESUME
    write_position = checkpoints.write_position  # the weights (fp16 for a position) and where the run stands
    save_checkpoint = checkpoints.save_checkpoint  # OUT/checkpoint with the optimizer, and the position
    _init_from_folder = checkpoints.init_from_folder
    _load_checkpoint = checkpoints.load_checkpoint

    # ---- the loop --------------------------------------------------------------------

    def log(self, record: dict):
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def _catch_stop_signals(self) -> dict:
        """SIGINT / SIGTERM ask the loop to stop at a step boundary with a checkpoint (a second
        one acts as before: the old handlers come back with the first). Returns the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        old = {s: signal.getsignal(s) for s in self.STOP_SIGNALS}

        def ask(signum, _frame):
            self.stopped_by = signum
            for s, h in old.items():
                signal.signal(s, h)
            if self.rank == 0:
                print(
                    f"\ntrain: {signal.Signals(signum).name}: stopping with a checkpoint at the end of this step "
                    f"({'at the next checkpoint step, ' if self.world > 1 else ''}again to stop at once)",
                    file=sys.stderr,
                )

        for s in self.STOP_SIGNALS:
            signal.signal(s, ask)
        return old

    def _stop_now(self, at_checkpoint: bool) -> bool:
        """Whether a stop signal ends the loop here: one process stops after the step it is in;
        several agree at each checkpoint step (a signal may reach them at different steps, or
        reach only some: every process takes part in the vote)."""
        if self.world == 1:
            return self.stopped_by is not None
        if not at_checkpoint:
            return False
        flag = torch.tensor([0 if self.stopped_by is None else int(self.stopped_by)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self.stopped_by = int(flag.item()) or None
        return self.stopped_by is not None

    def run(self, until: int | None = None):
        """Train to cfg.max_steps (the schedule's length), or stop early at step `until` with a
        checkpoint there (e.g. where a WSD decay branch leaves the run). SIGINT / SIGTERM stop it
        at a step boundary with a checkpoint (`stopped_by` names the signal; --resume continues
        bit for bit)."""
        old_handlers = self._catch_stop_signals()
        try:
            self._run(until)
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)

    def _run(self, until: int | None):
        cfg = self.cfg
        stop = cfg.max_steps if until is None else min(until, cfg.max_steps)
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.drafter.parameters())
            print(
                f"train: {len(self.samples)} sequences, drafter {n_params / 1e6:.1f}M params, "
                f"block {cfg.block_size}, {cfg.arch} with {self.kind.describe(self.drafter)}, "
                f"target layers {self.drafter.config.target_layer_ids}, "
                f"{self.world} process(es), from step {self.step}",
                file=sys.stderr,
            )
        self.drafter.train()
        self._t0 = time.perf_counter()
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=self.rank != 0, desc="train", dynamic_ncols=True)
        while self.step < stop:
            record = self.train_step()
            self.tokens_seen += record["tokens"] * self.world
            record["tokens_seen"] = self.tokens_seen
            record["elapsed"] = self.elapsed + time.perf_counter() - self._t0
            bar.update(1)
            evaluate = (cfg.eval_every > 0 and self.step % cfg.eval_every == 0) or self.step == cfg.max_steps
            if self.step % cfg.log_every == 0 or evaluate:  # the only host syncs of the loop
                record = self.host_record(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['acc'][0]:.2f}")
                if evaluate:
                    record["tau"] = self.evaluate_tau()
                    bar.write(f"step {self.step}: loss {record['loss']:.3f}, tau {record['tau']:.2f}")
                self.log(record)
            at_checkpoint = self.step % cfg.save_every == 0 or self.step == stop
            if at_checkpoint:
                self.save_checkpoint()
                if self.world > 1:
                    torch.distributed.barrier()
            if self._stop_now(at_checkpoint):
                if not at_checkpoint:
                    self.save_checkpoint()
                bar.write(
                    f"train: stopped at step {self.step} of {cfg.max_steps}, checkpoint in "
                    f"{self.out / 'checkpoint'}; --resume continues",
                    file=sys.stderr,
                )
                break
        bar.close()
        self.elapsed, self._t0 = self.elapsed + time.perf_counter() - self._t0, time.perf_counter()
        if self.features is not None and self.rank == 0:
            print(
                f"train: feature cache {self.features.folder}: {len(self.features)} samples, "
                f"{self.features.hits} steps read it whole, {self.features.misses} ran the target for some "
                "or all of their samples",
                file=sys.stderr,
            )
        if self.step < cfg.max_steps:  # stopped at `until` or by a signal: the checkpoint holds the state
            return
        if self.world > 1:  # DDP must leave every process with the same weights
            flat = torch.cat([p.detach().flatten() for p in self.drafter.parameters()])
            sums = [torch.zeros(2) for _ in range(self.world)]
            torch.distributed.all_gather(sums, torch.stack([flat.sum(), (flat * flat).sum()]).cpu().float())
            if any(not torch.equal(sums[0], x) for x in sums[1:]):
                raise RuntimeError("DDP processes ended with different weights")
            if self.rank == 0:
                print(f"train: {self.world} processes in sync", file=sys.stderr)
        if self.rank == 0:
            self.drafter.save(self.out / "drafter")

    def close(self):
        """Leave the process group (DDP; nothing on one process), every process together once rank 0
        has saved, whether the run ended or a signal stopped it. The DDP wrapper goes first: its
        reducer holds the group, and a group still held when the interpreter shuts down ends its
        gloo threads there, which can abort the process after a finished run."""
        if self.world == 1 or not torch.distributed.is_initialized():
            return
        self.model = self.drafter
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
