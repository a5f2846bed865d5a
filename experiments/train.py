"""Train a CNN under a layout and mesh; write results/<run>.json and results/<run>.csv.

python experiments/train.py                                  # dp over all devices
python experiments/train.py --layout single                  # the one-device baseline
python experiments/train.py --mesh data=4 --host-devices 4   # 4 simulated CPU devices
python experiments/train.py --layout hybrid --mesh data=4,model=2 --print-shardings
python experiments/train.py --grad-accum 4 --remat full --dtype bfloat16
python experiments/train.py --sync local-sgd --sync-every 8 --optimizer sgd --lr 0.05
python experiments/train.py --batch-schedule 0:32,10:64,20:128 --lr-scaling linear --base-batch 32
"""

from jaxcnn import cli
from jaxcnn.run import PROG, parse_flags, train


def main(argv=None) -> dict:
    return train(parse_flags(argv, __doc__))


if __name__ == "__main__":
    cli.run_main(PROG, main)
