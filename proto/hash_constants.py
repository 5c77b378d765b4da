"""The block hash's constants, shared by the Python chain (``hashing``) and the compiled one
(``hashing_nb``) so that neither module imports the other's."""

_MASK = (1 << 64) - 1

# Odd multiplier (invertible mod 2**64) for the chain, and the token pre-mix constants.
_A = 0x9E3779B97F4A7C15
_TOKEN_XOR = 0x2545F4914F6CDD1D
_TOKEN_MUL = 0xD6E8FEB86659FD93

# fmix64 constants (MurmurHash3 finaliser).
_F1 = 0xFF51AFD7ED558CCD
_F2 = 0xC4CEB9FE1A85EC53
