"""Global-to-local graph rewriting and lowering of planned steps to functional collectives."""
