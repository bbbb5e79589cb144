"""Math reasoning for the recipes and examples: datasets (``data``), verifiable rewards (``rewards``), a cached
cold-start SFT (``cold_start``) and a calculator tool (``tools``).

Nothing in the trainer imports these; they depend on nothing else in the package.
"""
