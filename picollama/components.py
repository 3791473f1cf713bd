"""Every component model.py's tables can name: importing this registers the lectures'
alternatives, RoPE's scalings, the length methods and the attention gate (model.py itself names
none of them)."""

# isort: off
# in this order, which is the order of the choices a message lists
from picollama import variants, rope_scaling, windowed_rope, length_encodings, attention_gate

# isort: on

__all__ = ["attention_gate", "length_encodings", "rope_scaling", "variants", "windowed_rope"]
