from rayfleet.models import ByteTokenizer


def test_round_trip_of_unicode_and_specials():
    tok = ByteTokenizer()
    text = "def f():\n    return 'héllo, 世界' 🚀"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) == len(text.encode()) + 2
    assert tok.decode(ids) == text
    assert tok.decode([tok.pad_id, 104, 105]) == "hi"


def test_special_ids_follow_the_bytes():
    tok = ByteTokenizer()
    assert tok.special_ids == {256, 257, 258} and tok.vocab_size == 259
    assert tok.to_dict()["name"] == "byte"
