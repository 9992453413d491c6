"""The code shipped next to converted weights: `configuration_attnres.py` and `modeling_attnres.py`, which
`from_pretrained(..., trust_remote_code=True)` imports without this package installed. So they import only torch,
transformers and the standard library (and, optionally, fla-core and this package's kernels where installed).

modeling_attnres.py is generated from sources/ by `python -m attnres_convert.modeling.generate` (generate.py).
"""

SHIPPED_CODE = ("configuration_attnres.py", "modeling_attnres.py")
