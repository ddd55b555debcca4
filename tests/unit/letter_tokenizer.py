"""A tokenizer for bench tests: any object with encode/decode, one token per lowercase letter."""


class LetterTokenizer:
    vocab_size = 26

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)
