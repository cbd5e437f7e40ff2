"""The built-in ``gpt``: a decoder-only transformer in the spirit of nanoGPT's model.py.

Token and position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention,
then a 4x MLP), a final LayerNorm and an output projection tied to the token embedding.
The synthetic batch is random tokens (throughput does not depend on what they say) and
the loss is next-token cross-entropy, a mean over the n x seq_len tokens of the batch.
With activation checkpointing, each `Block` recomputes its activations in the backward
pass (mbtune.models.checkpointing). Its weights are `GPT.init_weights()`'s draws from torch's
RNG, nothing else: the modules are made on the meta device first, so a model built on the
meta device and sharded (mbtune.trial.sharding) is initialised to the same values.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mbtune.models.parallel import ParallelParts
from mbtune.models.spec import Batch, ModelSpec, batch_mixing_reason

__all__ = ["GPT", "GPTMLP", "GPTStage", "Block", "CausalSelfAttention", "build_gpt", "gpt_parts"]


class CausalSelfAttention(nn.Module):
    """Causal self-attention with its query, key and value projections apart, so that a
    tensor-parallel plan shards each by heads (one fused projection would give rank 0 the
    queries and half the keys). Their weights are the rows of nanoGPT's fused ``c_attn``:
    drawn one after another from the same RNG stream, they are its values. The number of
    heads is read from the projections' width, so a shard of them runs its own heads."""

    def __init__(self, *, n_head: int, d_model: int, dropout: float):
        super().__init__()
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head  # the model's; a tensor-parallel shard runs n_head / t of them
        self.head_dim = d_model // n_head
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()  # batch, sequence length, d_model
        # (B, T, C) -> (B, heads, T, head_dim): heads become a batch dimension; C and the
        # heads are this rank's (all of them without tensor parallelism)
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, *, d_model: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, *, n_head: int, d_model: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(n_head=n_head, d_model=d_model, dropout=dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = GPTMLP(d_model=d_model, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embedding, n_layer blocks, final LayerNorm, tied lm_head."""

    shard_blocks = ("Block",)
    """The blocks a sharded trial makes FSDP units of (mbtune.trial.sharding)."""

    def __init__(
        self,
        *,
        n_layer: int,
        n_head: int,
        d_model: int,
        seq_len: int,
        vocab_size: int,
        dropout: float,
    ):
        super().__init__()
        # the modules without memory or values, then their memory where the caller builds
        # (the CPU, or the meta device itself): init_weights alone draws the weights
        device = torch.empty(0).device
        with torch.device("meta"):
            self._make(n_layer, n_head, d_model, seq_len, vocab_size, dropout)
        if device.type != "meta":
            self.to_empty(device=device)
            self.lm_head.weight = self.wte.weight
            self.init_weights()

    def _make(
        self, n_layer: int, n_head: int, d_model: int, seq_len: int, vocab_size: int, dropout: float
    ) -> None:
        self.n_layer = n_layer
        self.wte = nn.Embedding(vocab_size, d_model)  # token embedding
        self.wpe = nn.Embedding(seq_len, d_model)  # position embedding
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_head=n_head, d_model=d_model, dropout=dropout) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        # weight tying: the output projection is the token embedding
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """nanoGPT's init from torch's RNG: N(0, 0.02), residual projections scaled down by
        the depth, LayerNorms at one and zero."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size) logits


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`GPT`: copies of its blocks ``[start, stop)``, of the
    embeddings on the first stage and of the final LayerNorm and head on the last (the tied
    head a copy of its own there: mbtune.models.parallel says how it stays tied)."""

    shard_blocks = ("Block",)

    def __init__(self, model: GPT, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        memo: dict[int, object] = {}  # one memo: a stage that is first and last stays tied
        self.copied_from: dict[str, str] = {}
        """Each part's path here -> the path of the model's module it copies."""

        def own(path: str, source: str | None = None) -> nn.Module:
            self.copied_from[path] = source or path
            return copy.deepcopy(model.get_submodule(source or path), memo)

        self.wte, self.wpe, self.drop = (own(p) if first else None for p in ("wte", "wpe", "drop"))
        self.blocks = nn.ModuleList(
            own(f"blocks.{i - start}", f"blocks.{i}") for i in range(start, stop)
        )
        self.ln_f, self.lm_head = (own(p) if last else None for p in ("ln_f", "lm_head"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # x: token ids (B, T)
            pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:  # x: (B, T, d_model)
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))  # (B, T, vocab_size) logits
        return x


def gpt_parts(model: GPT) -> ParallelParts:
    """How a GPT splits into stages and shards by heads: q, k, v and the MLP's first layer
    by columns, the projections back by rows."""
    block = model.blocks[0]
    return ParallelParts(
        num_blocks=len(model.blocks),
        make_stage=functools.partial(GPTStage, model),
        io=lambda batch: ((batch[0],), batch[1]),
        loss=_next_token_loss,
        tp_plan={
            **{f"blocks.*.attn.{p}": "colwise" for p in ("q", "k", "v")},
            "blocks.*.attn.c_proj": "rowwise",
            "blocks.*.mlp.c_fc": "colwise",
            "blocks.*.mlp.c_proj": "rowwise",
        },
        tp_divides={
            "attention heads (model.n_head)": block.attn.q.out_features // block.attn.head_dim,
            "MLP width (4 x model.d_model)": block.mlp.c_fc.out_features,
        },
        tied=(("wte.weight", "lm_head.weight"),),
        init=GPT.init_weights,  # every weight drawn there, none as the modules are made
    )


def build_gpt(
    *, n_layer: int, n_head: int, d_model: int, seq_len: int, vocab_size: int, dropout: float
) -> ModelSpec:
    """The model, its batch of random tokens and its next-token loss (options checked by
    mbtune.config.model_options.check_options: d_model divisible by n_head)."""
    module = GPT(
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        seq_len=seq_len,
        vocab_size=vocab_size,
        dropout=dropout,
    )
    return ModelSpec(
        module=module,
        make_batch=functools.partial(_batch, seq_len=seq_len, vocab_size=vocab_size),
        loss_fn=_loss,
        tokens_per_sample=seq_len,
        mixes_batch=batch_mixing_reason(module),
    )


def _batch(n: int, device: torch.device, *, seq_len: int, vocab_size: int) -> Batch:
    # random tokens: throughput does not depend on what the tokens say
    idx = torch.randint(vocab_size, (n, seq_len), dtype=torch.long, device=device)
    targets = torch.randint(vocab_size, (n, seq_len), dtype=torch.long, device=device)
    return idx, targets


def _loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    idx, targets = batch
    return _next_token_loss(module(idx), targets)


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits (n, T, V): the mean over all n*T tokens; every sample has T tokens, so it is
    # also the mean over samples
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
