"""longctx: long-context attention for LLM inference, built on one exact (O, LSE) merge layer.

Tensor layout is FlashAttention's, [batch, seq, heads, head_dim]; LSE is float32 natural log
(float64 for float64 inputs, CPU), shaped like its O without head_dim ([batch, seq, heads];
decode [batch, heads]) in every call.
"""

from longctx.attention import attention, attention_merge_into
from longctx.decode import decode
from longctx.merge import merge_into, merge_states, merge_states_group
from longctx.reference import reference_attention

__all__ = ["attention", "attention_merge_into", "decode", "merge_states", "merge_into", "merge_states_group", "reference_attention"]
__version__ = "0.1.0"
