"""Train the entmax / softmax twin models (see entmaxkv/model/train.py).

    PYTHONPATH=. python scripts/train_twins.py --out checkpoints --time-budget 300
"""
import sys

from entmaxkv.model.train import main

if __name__ == "__main__":
    sys.exit(main())
