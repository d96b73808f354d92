"""An EAGLE-3-style drafter: the baseline DFlash is measured against.

One decoder layer drafts a chain of tokens one at a time. Its input at slot s is
the concatenation of the (normed) embedding of token x_{s+1} and a (normed)
hidden state: for committed positions, the target's low/mid/high layer features
fused by `fc`; for draft positions, the layer's own previous output. The output,
through the target's LM head, predicts x_{s+2}.

Training uses the training-time test of EAGLE-3: each chain is unrolled for
B-1 steps, feeding the layer's own hidden states back, with the attention mask
the decode loop will see (committed slots up to the chain's start, then the
chain's own draft slots). Chains start at the same random anchors as DFlash
blocks and carry the same labels, so `blockdraft train --arch eagle3` trains it on
the same data with the same pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_weights, read_config
from .draft import DrafterBase
from .errors import BlockdraftError
from .models.config import TargetConfig
from .models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, attend

ARCHITECTURE = "Eagle3DraftModel"
LABEL = "EAGLE-3-style drafter"  # how messages name the kind


def eagle_layer_ids(num_target_layers: int) -> list[int]:
    """Low, middle and high target layers (EAGLE-3 fuses three)."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


@dataclass
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int = 8  # 1 + the longest chain trained (the verified block)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    draft_vocab_size: int | None = None

    @classmethod
    def for_target(
        cls,
        target: TargetConfig,
        *,
        block_size: int = 8,
        target_layer_ids: list[int] | None = None,
        draft_vocab_size: int | None = None,
    ) -> EagleConfig:
        return cls(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=list(target_layer_ids or eagle_layer_ids(target.num_hidden_layers)),
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            draft_vocab_size=draft_vocab_size,
        )

    def to_dict(self) -> dict:
        return {"architectures": [ARCHITECTURE], **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict) -> EagleConfig:
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise BlockdraftError(f"EAGLE drafter config.json: {exc}") from None


class EagleDrafter(DrafterBase):
    kind = "eagle3"

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = Rotary(d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.register_draft_vocab(cfg.draft_vocab_size)

    # ---- the layer ---------------------------------------------------------------------

    def _inputs(self, embeds, hidden):
        return torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)

    def qkv(self, embeds, hidden, positions):
        """q [B,H,T,D] and k, v [B,KV,T,D] (rotated) of slots with these inputs at `positions`."""
        b, t, _ = embeds.shape
        u = self._inputs(embeds, hidden)
        cos, sin = self.rotary(positions, u.dtype)
        q = self.q_proj(u).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(u).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, hidden, q, k, v, mask):
        """Attention over (k, v) then the MLP; the residual stream is the hidden input."""
        b, _, t, _ = q.shape
        x = hidden + self.o_proj(attend(q, k, v, mask).transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    # ---- training: the training-time test ------------------------------------------------

    def forward(
        self, embed, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, teacher: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [N, A*B, H] laid out like DFlash blocks (block offset k holds chain
        step k, predicting x_{a+k}; offset 0 is unused).

        tokens [N, L] and the target's features [N, L, k*H]; anchors [N, A] (a >= 1; the
        chain starts at slot a-1 with token x_a); teacher [N, A, B-1]: x_a .. x_{a+B-2},
        the token fed at each step (the true one: after a wrong draft nothing counts).
        """
        n, length = tokens.shape
        a_count, steps = anchors.shape[1], teacher.shape[2]
        fused = self.fc(features)  # [N, L, H]
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # slot s reads x_{s+1}
        positions = torch.arange(length, device=tokens.device).expand(n, -1)
        _, k_real, v_real = self.qkv(embed(nxt), fused, positions)
        start = (anchors - 1).clamp(min=0)  # [N, A]; padding anchors (0) carry no labels
        hidden = fused.gather(1, start[..., None].expand(-1, -1, fused.shape[-1]))
        real_visible = torch.arange(length, device=tokens.device) <= start[..., None]  # [N, A, L]
        own_k, own_v, outs = [], [], []
        eye = torch.eye(a_count, dtype=torch.bool, device=tokens.device)
        for j in range(steps):
            q, k, v = self.qkv(embed(teacher[:, :, j]), hidden, start + j)
            if j > 0:
                own_k.append(k)
                own_v.append(v)
            keys = torch.cat([k_real, *own_k], dim=2)
            values = torch.cat([v_real, *own_v], dim=2)
            mask = torch.cat([real_visible, eye.expand(n, -1, -1).repeat(1, 1, len(own_k))], dim=-1)
            hidden = self.finish(hidden, q, keys, values, mask[:, None])
            outs.append(self.norm(hidden))
        stacked = torch.stack([torch.zeros_like(outs[0]), *outs], dim=2)  # [N, A, B, H]
        return stacked.reshape(n, a_count * (steps + 1), -1)

    # ---- checkpoints ---------------------------------------------------------------------

    @classmethod
    def load(cls, folder: str | Path, device=None, dtype: torch.dtype | None = None) -> EagleDrafter:
        cfg = EagleConfig.from_dict(read_config(folder, ARCHITECTURE, label=LABEL))
        return load_weights(cls, cfg, folder, device, dtype)

    def check_target(self, target: TargetConfig):
        cfg = self.config
        if (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) != (
            target.hidden_size,
            target.vocab_size,
            target.num_hidden_layers,
        ):
            raise BlockdraftError("EAGLE drafter does not match the target (hidden size, vocabulary or depth)")
