"""Golden bytes: the on-stream layout of every codec, frozen.

A change in any byte here means old checkpoints would decode differently: that needs a NEW codec
id (registry.py), never an edit of an existing codec. Vectors were produced by this package and
checked by hand for asym4 (row 0: bias -1.5 = fp16 0xbe00, scale 3.5/15 = fp16 0x3377, codes
0,3,6,8,9,11,14,15 packed low nibble first = 30 86 b9 fe) and sym2 (constant 0.3 -> code +1 ->
0b10 in every slot = 0xaa, absmax fp16 0x34cd).

Adaptive codecs are the exception on the ENCODE side only: their rows are asymN rows (decode is
asymN decode and never changes), but which range the encoder picks depends on its search, so the
encoder bytes of ``adaptiveN`` may change with the search (a new search, new defaults) without a
new codec id: old rows still decode the same. Their encoder bytes are therefore pinned per search:
``GOLDEN`` holds the default (fast) search, the same bytes from the numba kernel and the torch
reference; ``GOLDEN_GREEDY`` the greedy search (``search="greedy"``, fbgemm's).
"""

from __future__ import annotations

import pytest
import torch

from ckpt.quant import codec_names, get_codec
from ckpt.quant.adaptive import AdaptiveCodec
from ckpt.quant.uniform import fbgemm_available, set_force_torch

from .test_quant_codecs import max_abs_error_bound

X8 = torch.tensor(
    [
        [-1.5, -0.75, 0.0, 0.3, 0.5, 1.0, 1.75, 2.0],
        [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [10.0, -0.1, 0.2, -0.3, 0.4, -0.5, 0.6, -0.7],
    ]
)  # dim 8: the fbgemm path for asym 2/4/8
X5 = torch.tensor([[0.1, -0.2, 0.3, -0.4, 0.5], [3.0, 1.0, 2.0, -1.0, 0.0]])  # dim 5: the torch path

GOLDEN = {
    "fp32": (
        [
            "0000c0bf000040bf000000009a99993e0000003f0000803f0000e03f00000040",
            "9a99993e9a99993e9a99993e9a99993e9a99993e9a99993e9a99993e9a99993e",
            "0000000000000000000000000000000000000000000000000000000000000000",
            "00002041cdccccbdcdcc4c3e9a9999becdcccc3e000000bf9a99193f333333bf",
        ],
        ["cdcccc3dcdcc4cbe9a99993ecdccccbe0000003f", "000040400000803f00000040000080bf00000000"],
    ),
    "fp16": (
        [
            "00be00ba0000cd340038003c003f0040",
            "cd34cd34cd34cd34cd34cd34cd34cd34",
            "00000000000000000000000000000000",
            "004966ae6632cdb4663600b8cd389ab9",
        ],
        ["662e66b2cd3466b60038", "0042003c004000bc0000"],
    ),
    "bf16": (
        [
            "c0bf40bf00009a3e003f803fe03f0040",
            "9a3e9a3e9a3e9a3e9a3e9a3e9a3e9a3e",
            "00000000000000000000000000000000",
            "2041cdbd4d3e9abecd3e00bf1a3f33bf",
        ],
        ["cd3d4dbe9a3ecdbe003f", "4040803f004080bf0000"],
    ),
    "asym2": (
        ["94faab3c00be", "ffff1181cd34", "0000003c0000", "030022439ab9"],
        ["2603cd3466b6", "2b01553d00bc"],
    ),
    "asym3": (
        ["d0c8fa003800be", "ffffff7580cd34", "000000003c0000", "4710041d3e9ab9"],
        ["54711d3066b6", "6721923800bc"],
    ),
    "asym4": (
        ["3086b9fe773300be", "ffffffff3780cd34", "00000000003c0000", "1f110202b5399ab9"],
        ["380c0fae2b66b6", "8f0b04443400bc"],
    ),
    "asym8": (
        [
            "00376d8392b6edffe1e0603c0000c0bf",
            "0000000000000000000000009a99993e",
            "00000000000000000000000000000000",
            "ff0e150a1a051f0012df2b3d333333bf",
        ],
        ["8e39c600ffb44d673bcdccccbe", "ff80bf00408180803c000080bf"],
    ),
    "sym2": (
        ["54a50040", "aaaacd34", "55550000", "56550049"],
        ["25020038", "66010042"],
    ),
    "sym3": (
        ["d1c6da0040", "b66ddbcd34", "dbb66d0000", "deb66d0049"],
        ["54630038", "66350042"],
    ),
    "sym4": (
        ["4287b9ed0040", "eeeeeeeecd34", "777777770000", "7e7777770049"],
        ["481b0e0038", "9e5c070042"],
    ),
    "sym8": (
        ["204f7f929fbfeefe00000040", "fefefefefefefefe9a99993e", "7f7f7f7f7f7f7f7f00000000", "fe7e827b8479877600002041"],
        ["984ccb19fe0000003f", "fea9d4557f00004040"],
    ),
    "adaptive2": (
        ["94fa713c1fbe", "ffff1181cd34", "0000003c0000", "0300b44246ab"],
        ["36036034eab6", "2701623d12bb"],
    ),
    "adaptive3": (
        ["c8c8fe753793bd", "ffffff7580cd34", "000000003c0000", "471004ff3d64b9"],
        ["94710f30c0b6", "6721a83862bc"],
    ),
    "adaptive4": (
        ["3087b9fe663318be", "ffffffff3780cd34", "00000000003c0000", "1f110202b7391eba"],
        ["380c0f892b33b6", "8f0b04513434bc"],
    ),
    "kmeans2": (
        ["94fa00be00b6cd38803f", "0000cd34cd34cd34cd34", "00000000000000000000", "030050abbc416f460049"],
        ["260366b666b266320038", "2b0100bc0000003e0042"],
    ),
    "kmeans3": (
        [
            "d0c8fe00be00bc00ba00006636003c003e803f",
            "000000cd34cd34cd34cd34cd34cd34cd34cd34",
            "00000000000000000000000000000000000000",
            "47100466b66636b740c5436a45f1463c480049",
        ],
        ["547166b658b466b250a3662ecd34f1350038", "672100bcdbb60000b739003c0040db400042"],
    ),
    "kmeans4": (
        [
            "3086b9fe00be11bd22bc00ba89b855b500004430cd340038ab3a003c333d223e003f0040",
            "00000000cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34cd34",
            "000000000000000000000000000000000000000000000000000000000000000000000000",
            "1f110202cdb844ac0038c33d4f40bc4129434b440245b8456f462647dc474948a5480049",
        ],
        [
            "380c0f66b671b57bb466b21fb166ae1fa91f25662e7b3066322934cd3414360a370038",
            "8f0b0400bcdeb977b766b200005535cd38ef3a003c9a3dab3e00406640ef4077410042",
        ],
    ),
}

GOLDEN_GREEDY = {  # the same codecs encoded with search="greedy" (the default search before the fast one)
    "adaptive2": (
        ["94fa633c00be", "ffff1181cd34", "0000003c0000", "0300b5426dab"],
        ["36030234f8b5", "2b011f3d00bc"],
    ),
    "adaptive3": (
        ["d0c8feb83700be", "ffffff7580cd34", "000000003c0000", "471004063e9ab9"],
        ["9471db2f66b6", "6721813800bc"],
    ),
    "adaptive4": (
        ["3087b9fe513300be", "ffffffff3780cd34", "00000000003c0000", "1f110202ae399ab9"],
        ["380c0f872b2fb6", "7f0b043f34d7bb"],
    ),
}


def _hex(t: torch.Tensor) -> list[str]:
    return [bytes(r.tolist()).hex() for r in t]


def test_every_codec_has_golden_bytes():
    assert sorted(GOLDEN) == sorted(codec_names())


@pytest.mark.parametrize("force_torch", [False, True])
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_encode(name, force_torch):
    if not force_torch and not fbgemm_available():
        pytest.skip("fbgemm_gpu not installed")
    old = set_force_torch(force_torch)
    try:
        c = get_codec(name)
        assert _hex(c.encode(X8)) == GOLDEN[name][0]
        assert _hex(c.encode(X5)) == GOLDEN[name][1]
    finally:
        set_force_torch(old)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_decode(name):
    # decoding the frozen bytes gives the frozen reconstruction, whichever path decodes it
    c = get_codec(name)
    for x, rows in ((X8, GOLDEN[name][0]), (X5, GOLDEN[name][1])):
        data = torch.tensor([list(bytes.fromhex(h)) for h in rows], dtype=torch.uint8)
        a = c.decode(data, x.shape[1])
        old = set_force_torch(True)
        try:
            b = c.decode(data, x.shape[1])
        finally:
            set_force_torch(old)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # and it is the input within the codec's error bound
        assert ((a - x).abs() <= max_abs_error_bound(name, x)).all()


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("name", sorted(GOLDEN_GREEDY))
def test_golden_encode_adaptive_fast_each_impl(name, impl):
    # the default (fast) search: the numba kernel and the torch reference give the pinned bytes
    if impl == "kernel":
        pytest.importorskip("numba", reason="numba not installed: the adaptive kernel is unavailable")
    c = AdaptiveCodec(get_codec(name).bits, impl=impl)
    assert c.search == "fast" and c.uses_kernel(X8) == (impl == "kernel")
    assert _hex(c.encode(X8)) == GOLDEN[name][0]
    assert _hex(c.encode(X5)) == GOLDEN[name][1]


@pytest.mark.parametrize("force_torch", [False, True])
@pytest.mark.parametrize("name", sorted(GOLDEN_GREEDY))
def test_golden_encode_adaptive_greedy(name, force_torch):
    if not force_torch and not fbgemm_available():
        pytest.skip("fbgemm_gpu not installed")
    old = set_force_torch(force_torch)
    try:
        c = AdaptiveCodec(get_codec(name).bits, search="greedy")
        assert _hex(c.encode(X8)) == GOLDEN_GREEDY[name][0]
        assert _hex(c.encode(X5)) == GOLDEN_GREEDY[name][1]
    finally:
        set_force_torch(old)


@pytest.mark.parametrize("name", sorted(GOLDEN_GREEDY))
def test_golden_decode_adaptive_greedy(name):
    # rows of either search are asymN rows: the codec decodes the greedy bytes as asymN does
    c, asym = get_codec(name), get_codec(name.replace("adaptive", "asym"))
    for x, rows in ((X8, GOLDEN_GREEDY[name][0]), (X5, GOLDEN_GREEDY[name][1])):
        data = torch.tensor([list(bytes.fromhex(h)) for h in rows], dtype=torch.uint8)
        a = c.decode(data, x.shape[1])
        assert torch.equal(a, asym.decode(data, x.shape[1]))
        assert ((a - x).abs() <= max_abs_error_bound(name, x)).all()
