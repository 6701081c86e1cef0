"""What every room shares: the validated request (``AttnRequest``, ``check_qkv``), the visibility /
ALiBi / dtype rules, the ``score_mod`` contract and the empty and non-finite edge cases. Imports
no other room."""
