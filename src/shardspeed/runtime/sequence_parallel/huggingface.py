"""ALST's Ulysses for Hugging Face models (DeepSpeed's `UlyssesSPAttentionHF`, same constructor,
forward and `register_with_transformers`): the attention function transformers calls is replaced
by one that runs over the whole sequence while each rank holds a slice of it.

In mode ulysses (the default, and DeepSpeed's only one) q, k, v are exchanged all-to-all over the
sequence group, the model's own attention function (sdpa, flash, flex) runs on the whole sequence
for 1/P of the heads, and the output is exchanged back. In modes ring and hybrid (the config's
`sequence_parallel.mode`) `shardspeed.sequence.sequence_attention` runs instead: plain softmax
attention, so settings that change it (dropout, a sliding window, logit soft-capping) are refused.
As in DeepSpeed, the model's 4-D attention masks are dropped (they describe the local slice, and
a whole-sequence mask is quadratic in memory): attention is causal over the whole sequence, and
packed documents are told apart by `position_ids` only where the attention kernel reads them
(flash attention). Implementations that need a mask (eager, flex_attention) are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ... import comm
from ...sequence import sequence_attention
from ...sequence.hybrid import kv_repeats
from ...sequence.ulysses import seq_all_to_all
from . import parallel_state_sp
from .plan import current_plan

# Settings of transformers' attention functions the ring cannot honour, with their neutral values.
_RING_NEUTRAL = {"dropout": 0.0, "sliding_window": None, "softcap": None, "s_aux": None}


class UlyssesSPAttentionHF(nn.Module):
    """Wraps transformers' attention function `attn` (`module, query, key, value, mask, ...` with
    `[batch, heads, seq, head_dim]` tensors, returning `(output [batch, seq, heads, head_dim],
    weights)`) for a sequence split over `process_group`.

    Head counts follow DeepSpeed: the query heads must be a multiple of the group size, and the
    key/value heads a multiple of it or a divisor of it (then they are repeated up to the group
    size, and the module's `num_key_value_groups` set to match). `seq_length_is_variable` false
    with `local_seq_length` refuses a batch of another length. `disable_in_eval` runs `attn` on the
    local slice when the module is in eval mode."""

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        self.kv_replication_factor = kv_repeats(attn_head_count, kv_head_count, self.world_size)

    def forward(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        """Attention for this rank's slice, `[batch, seq/P, heads * head_dim]` out."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_length(query.shape[2])
        batch, local_len = query.shape[0], query.shape[2]
        plan = current_plan()
        groups = plan.groups()
        if groups.ring_size == 1:
            out, weights = self._ulysses(module, query, key, value, attention_mask, args, kwargs)
        else:
            out, weights = self._ring(module, query, key, value, groups, args, kwargs)
        return out.reshape(batch, local_len, -1), weights

    def _ulysses(self, module, query, key, value, attention_mask, args, kwargs):
        if self.kv_replication_factor > 1:
            key, value = (t.repeat_interleave(self.kv_replication_factor, 1) for t in (key, value))
        query, key, value = (
            seq_all_to_all(t, 1, 2, self.process_group) for t in (query, key, value)
        )
        # The heads that stay together on a rank keep their pairing; the ratio changes only when
        # key/value heads were repeated.
        module.num_key_value_groups = query.shape[1] // key.shape[1]
        if torch.is_tensor(kwargs.get("position_ids")):
            kwargs["position_ids"] = _gather_positions(kwargs["position_ids"], self.process_group)
        out, weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        # [batch, seq, heads/P, head_dim] -> [batch, seq/P, heads, head_dim]
        return seq_all_to_all(out, 1, 2, self.process_group), weights

    def _ring(self, module, query, key, value, groups, args, kwargs):
        changed = {
            name: kwargs[name]
            for name, neutral in _RING_NEUTRAL.items()
            if kwargs.get(name, neutral) is not None and kwargs.get(name, neutral) != neutral
        }
        if args or changed:
            raise ValueError(
                f"ring and hybrid sequence parallelism run plain softmax attention, but the "
                f"model's attention passes {sorted(changed) or 'extra arguments'}: use the "
                "config's sequence_parallel.mode ulysses for this model"
            )
        out = sequence_attention(
            query, key, value, groups, causal=getattr(module, "is_causal", True),
            scale=kwargs.get("scaling"),
        )  # fmt: skip
        return out.transpose(1, 2), None

    def _check_length(self, local_len: int) -> None:
        if self.seq_length_is_variable:
            return
        if self.local_seq_length is None:
            self.local_seq_length = local_len
        if local_len != self.local_seq_length:
            raise ValueError(
                f"this rank's slice has {local_len} positions, but the sequence length was "
                f"declared fixed ({self.local_seq_length} per rank; seq_length_is_variable is "
                "false): pad every batch to one length, or declare it variable"
            )

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """Set up the sequence groups and put the wrapper in place of transformers' attention
        function `core_attn_implementation`; returns the `mpu` for `initialize` (None when
        `sequence_parallel_size` is 1). `model_name_or_path`: a loaded model (or anything with a
        `config`), or a name or path for `AutoConfig`. `max_length` is the old name of
        `seq_length`."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "seq_length_is_variable is False, so give seq_length: the one sequence length "
                "of every batch"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        loaded = hasattr(model_name_or_path, "config")
        hf_config = (
            model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        )
        model_attn = getattr(hf_config, "_attn_implementation", None) if loaded else None
        if model_attn is not None and model_attn != core_attn_implementation:
            raise ValueError(
                f"core_attn_implementation is {core_attn_implementation!r} but the model runs "
                f"attn_implementation {model_attn!r}: load the model with the same one"
            )
        if core_attn_implementation in ("eager", "paged|eager", "flex_attention"):
            raise ValueError(
                f"attn_implementation {core_attn_implementation!r} needs a mask over the whole "
                "sequence, which sequence parallelism does not build: load the model with "
                "'sdpa' or a flash attention"
            )
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{core_attn_implementation!r} is not an attention implementation transformers "
                f"knows; choose one of {list(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
            )
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        core = getattr(core, "sequence_parallel_core", core)  # registered twice: wrap the original
        text = hf_config.get_text_config()
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size
        attention = cls(
            core,
            micro_batch_size,
            text.num_attention_heads,
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            text.num_key_value_heads,
            text.num_hidden_layers,
            parallel_state_sp.get_sequence_parallel_group(),
            seq_length_is_variable,
            local,
            None if seq_length_is_variable else seq_length,
            disable_in_eval,
        )
        attention.core_attn_implementation = core_attn_implementation

        def sequence_parallel_attention(module, query, key, value, attention_mask, *args, **kwargs):
            del attention_mask  # the local slice's: see the module docstring
            return attention(module, query, key, value, None, *args, **kwargs)

        sequence_parallel_attention.sequence_parallel_core = core
        # Replacing the implementation's entry (rather than registering a new name) keeps every
        # branch transformers takes on the configured name.
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = sequence_parallel_attention
        return parallel_state_sp


def _gather_positions(position_ids: Tensor, group: Any) -> Tensor:
    """Every rank's position ids joined along the sequence, in rank order."""
    pieces = [torch.empty_like(position_ids) for _ in range(comm.get_world_size(group))]
    comm.all_gather(pieces, position_ids.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)
