"""Write data/train.csv and data/test.csv from scikit-learn's handwritten digits.

The files follow the Kaggle "Digit Recognizer" layout: a `label` column, then
`pixel0` ... `pixel63` (8x8 images, row-major, integer intensities 0..16).
The split is stratified, 80/20, with a fixed seed, so rerunning this script
reproduces the committed files byte for byte.

    python data/make_digits.py        # needs scikit-learn: pip install -e '.[data]'
"""

from pathlib import Path

import pandas as pd
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SEED = 0
TEST_FRACTION = 0.2


def main() -> None:
    digits = load_digits()
    pixels = digits.data.astype(int)
    frame = pd.DataFrame(pixels, columns=[f"pixel{i}" for i in range(pixels.shape[1])])
    frame.insert(0, "label", digits.target.astype(int))
    train, test = train_test_split(frame, test_size=TEST_FRACTION, stratify=frame["label"], random_state=SEED)
    out = Path(__file__).parent
    train.to_csv(out / "train.csv", index=False)
    test.to_csv(out / "test.csv", index=False)
    print(f"wrote {len(train)} training and {len(test)} test images to {out}")


if __name__ == "__main__":
    main()
