"""Feature extraction streams a dataset: a lazy dataset (ImageNet's validation set is 50,000
images) is decoded a batch or two ahead of the model, never whole, and the outputs are those of
encoding every image in order."""

import numpy as np
import torch

from nclip.data.synthetic import SyntheticScenes
from nclip.eval.features import encode_images, extract


class _Counting:
    """A lazy dataset that counts the samples handed out."""

    def __init__(self, data):
        self.data, self.fetched = data, 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.fetched += 1
        return self.data[i]


class _Model(torch.nn.Module):
    """Records how many samples had been fetched when each batch reached the image tower."""

    def __init__(self, source: _Counting):
        super().__init__()
        self.source, self.seen = source, []

    @staticmethod
    def tokenizer(texts):
        ids = torch.tensor([[len(t)] for t in texts])
        return ids, torch.ones_like(ids)

    def encode_text(self, ids, mask):
        return {"features": ids.float()}

    def encode_image(self, pixels):
        self.seen.append((len(pixels), self.source.fetched))
        return {"features": pixels.flatten(1)[:, :5] * 2}


def test_images_are_decoded_a_batch_ahead_not_all_at_once():
    data = _Counting(SyntheticScenes("test", length=50, image_size=16))
    model = _Model(data)
    feats = extract(model, data, 16, "cpu", batch_size=8, texts=True)
    assert [n for n, _ in model.seen] == [8] * 6 + [2]
    for k, (_, fetched) in enumerate(model.seen):
        assert fetched <= 8 * (k + 2), (k, fetched)  # this batch and the next, at most
    images = [data.data[i].image for i in range(50)]
    want = encode_images(model, images, 16, "cpu", batch_size=8)
    torch.testing.assert_close(feats.image["features"], want["features"], rtol=0, atol=0)
    assert feats.labels["shape"].tolist() == [data.data[i].labels["shape"] for i in range(50)]
    owners = np.repeat(np.arange(50), [len(data.data[i].captions) for i in range(50)])
    assert feats.text_to_image.tolist() == owners.tolist()
