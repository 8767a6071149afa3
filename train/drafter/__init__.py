"""The drafter: the DFlash (and DFlash2) model, its RoPE, block attention and loss, its checkpoint layout and
fields, and the target pieces it borrows (embedding, LM head). Every other part of train/ imports it; it imports
none of them."""
