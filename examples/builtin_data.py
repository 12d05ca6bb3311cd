"""The built-in data of the examples: a small rule-based language pair, generated deterministically.

The source side is simplified English; the target side ("Zelan", code ``zl``) is an invented language
whose grammar differs from English in the ways that make translation more than word substitution:

- word order: English S V O [PP] [ADV] becomes Zelan [PP] S O [ADV] [NEG] V (verb-final, the
  prepositional phrase moves to the front and its preposition becomes a postposition);
- noun phrases: adjectives and numerals follow the noun ("the two big dogs" → "li dorakar velni du");
- agreement: two noun genders; determiners agree with the noun in gender, number and case (subject or
  object), adjectives in gender and number, the verb with the subject in person and number;
- morphology: tense (present, past, future) and person are verb suffixes, subject pronouns are
  dropped (the verb ending carries them), plural is a noun suffix; English has its own irregular
  plurals and past tenses and "a"/"an".

English is kept unambiguous ("you" is always singular, no verbs whose present and past look alike,
prepositional phrases attach to the clause only), so every source sentence has exactly one correct
translation and BLEU can approach 100 for a model that learns the grammar.

Everything comes from a counter-based generator (splitmix64) seeded by an integer, never from
``random``'s or numpy's algorithms (which may change between versions): the same seed gives the same
corpus on every machine.

Run ``python examples/builtin_data.py DIR [--train-pairs N]`` to write the corpus files (train/valid/test
.en/.zl and lm.*.txt); ``--train-pairs`` sizes the translation corpus (default 30000).
"""
import os

MASK64 = (1 << 64) - 1


class SplitMix64:
    """A tiny deterministic PRNG (splitmix64): the same numbers on every platform and Python version."""

    def __init__(self, seed):
        self.state = (int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & MASK64

    def next64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n):
        return self.next64() % n

    def random(self):
        return (self.next64() >> 11) / float(1 << 53)

    def chance(self, p):
        return self.random() < p

    def choice(self, seq):
        return seq[self.below(len(seq))]


# ---- English lexicon ------------------------------------------------------------------------------
# nouns: singular, plural
NOUNS = [
    ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("horse", "horses"), ("cow", "cows"), ("fish", "fishes"),
    ("mouse", "mice"), ("wolf", "wolves"), ("bear", "bears"), ("fox", "foxes"), ("rabbit", "rabbits"),
    ("duck", "ducks"), ("goat", "goats"), ("lion", "lions"), ("tiger", "tigers"), ("snake", "snakes"),
    ("frog", "frogs"), ("bee", "bees"), ("man", "men"), ("woman", "women"), ("child", "children"),
    ("boy", "boys"), ("girl", "girls"), ("king", "kings"), ("queen", "queens"), ("farmer", "farmers"),
    ("teacher", "teachers"), ("doctor", "doctors"), ("student", "students"), ("friend", "friends"),
    ("brother", "brothers"), ("sister", "sisters"), ("mother", "mothers"), ("father", "fathers"),
    ("baby", "babies"), ("soldier", "soldiers"), ("baker", "bakers"), ("singer", "singers"),
    ("sailor", "sailors"), ("painter", "painters"), ("house", "houses"), ("tree", "trees"), ("river", "rivers"),
    ("mountain", "mountains"), ("city", "cities"), ("village", "villages"), ("garden", "gardens"),
    ("forest", "forests"), ("field", "fields"), ("road", "roads"), ("bridge", "bridges"), ("door", "doors"),
    ("window", "windows"), ("table", "tables"), ("chair", "chairs"), ("bed", "beds"), ("book", "books"),
    ("letter", "letters"), ("song", "songs"), ("story", "stories"), ("box", "boxes"), ("cup", "cups"),
    ("bottle", "bottles"), ("knife", "knives"), ("apple", "apples"), ("orange", "oranges"), ("cake", "cakes"),
    ("egg", "eggs"), ("flower", "flowers"), ("stone", "stones"), ("ship", "ships"), ("boat", "boats"),
    ("car", "cars"), ("train", "trains"), ("key", "keys"), ("ring", "rings"), ("coin", "coins"),
    ("shoe", "shoes"), ("hat", "hats"), ("coat", "coats"), ("bag", "bags"), ("lamp", "lamps"),
    ("clock", "clocks"), ("picture", "pictures"), ("map", "maps"), ("rope", "ropes"), ("wheel", "wheels"),
    ("wall", "walls"), ("island", "islands"), ("lake", "lakes"), ("star", "stars"), ("cloud", "clouds"),
    ("hill", "hills"), ("shop", "shops"), ("school", "schools"), ("market", "markets"),
    ("church", "churches"), ("castle", "castles"), ("tower", "towers"), ("kitchen", "kitchens"),
    ("room", "rooms"), ("street", "streets"), ("park", "parks"), ("beach", "beaches"), ("ball", "balls"),
    ("drum", "drums"), ("bell", "bells"), ("candle", "candles"), ("basket", "baskets"), ("pencil", "pencils"),
    ("glass", "glasses"), ("dress", "dresses"), ("shirt", "shirts"), ("sword", "swords"),
    ("shield", "shields"), ("owl", "owls"), ("ant", "ants"), ("elephant", "elephants"), ("uncle", "uncles"),
    ("aunt", "aunts"), ("engine", "engines"), ("umbrella", "umbrellas"), ("onion", "onions"),
]
# transitive verbs: base, third person singular, past
VERBS_T = [
    ("see", "sees", "saw"), ("find", "finds", "found"), ("take", "takes", "took"), ("bring", "brings", "brought"),
    ("carry", "carries", "carried"), ("eat", "eats", "ate"), ("drink", "drinks", "drank"), ("buy", "buys", "bought"),
    ("sell", "sells", "sold"), ("build", "builds", "built"), ("open", "opens", "opened"),
    ("close", "closes", "closed"), ("watch", "watches", "watched"), ("love", "loves", "loved"),
    ("like", "likes", "liked"), ("want", "wants", "wanted"), ("help", "helps", "helped"),
    ("call", "calls", "called"), ("visit", "visits", "visited"), ("follow", "follows", "followed"),
    ("push", "pushes", "pushed"), ("pull", "pulls", "pulled"), ("paint", "paints", "painted"),
    ("clean", "cleans", "cleaned"), ("break", "breaks", "broke"), ("hold", "holds", "held"),
    ("throw", "throws", "threw"), ("catch", "catches", "caught"), ("cook", "cooks", "cooked"),
    ("wash", "washes", "washed"), ("draw", "draws", "drew"), ("write", "writes", "wrote"), ("hide", "hides", "hid"),
    ("lose", "loses", "lost"), ("keep", "keeps", "kept"), ("meet", "meets", "met"), ("know", "knows", "knew"),
    ("hear", "hears", "heard"), ("forget", "forgets", "forgot"), ("need", "needs", "needed"),
]
# intransitive verbs
VERBS_I = [
    ("sleep", "sleeps", "slept"), ("run", "runs", "ran"), ("walk", "walks", "walked"), ("sing", "sings", "sang"),
    ("dance", "dances", "danced"), ("swim", "swims", "swam"), ("laugh", "laughs", "laughed"),
    ("cry", "cries", "cried"), ("wait", "waits", "waited"), ("work", "works", "worked"),
    ("play", "plays", "played"), ("jump", "jumps", "jumped"), ("fall", "falls", "fell"), ("sit", "sits", "sat"),
    ("stand", "stands", "stood"), ("smile", "smiles", "smiled"), ("arrive", "arrives", "arrived"),
    ("travel", "travels", "travelled"), ("rest", "rests", "rested"), ("shout", "shouts", "shouted"),
]
ADJECTIVES = [
    "big", "small", "old", "young", "new", "red", "blue", "green", "black", "white", "happy", "sad", "tall",
    "short", "long", "quick", "slow", "warm", "cold", "dark", "bright", "strong", "weak", "rich", "poor",
    "clean", "dirty", "quiet", "loud", "heavy", "beautiful", "ugly", "brave", "kind", "wild", "gentle",
    "famous", "strange", "empty", "hungry", "tired", "angry", "yellow", "soft",
]
ADVERBS = ["quickly", "slowly", "often", "today", "yesterday", "again", "together", "quietly", "early", "later"]
PREPOSITIONS = ["in", "on", "near", "under", "behind", "beside", "with", "from"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
CONJUNCTIONS = ["and", "but", "because"]
# person: 0 = 1sg, 1 = 2sg, 2 = 3sg, 3 = 1pl, 4 = 3pl
SUBJECT_PRONOUNS = [("I", 0), ("you", 1), ("he", 2), ("she", 2), ("we", 3), ("they", 4)]
OBJECT_PRONOUNS = {"I": "me", "you": "you", "he": "him", "she": "her", "we": "us", "they": "them"}
# determiners: English singular form, English plural form (None: not used there), Zelan stem
DETERMINERS = [
    ("the", "the", "l"), ("a", None, "un"), ("this", "these", "et"), ("that", "those", "ob"), ("my", "my", "mir"),
    ("your", "your", "tir"), ("his", "his", "sir"), ("her", "her", "sar"), ("our", "our", "nor"),
    ("their", "their", "vor"), ("every", None, "kaz"), (None, "some", "pel"),
]

# ---- Zelan grammar --------------------------------------------------------------------------------
# determiner endings by (gender, plural, object)
DET_ENDING = {("a", False, False): "o", ("a", False, True): "om", ("b", False, False): "a",
              ("b", False, True): "am", ("a", True, False): "i", ("a", True, True): "im",
              ("b", True, False): "e", ("b", True, True): "em"}
ADJ_ENDING = {("a", False): "e", ("b", False): "a", ("a", True): "ni", ("b", True): "ne"}
NOUN_PLURAL = {"a": "en", "b": "ar"}
TENSE_SUFFIX = {"present": "", "past": "ev", "future": "ul"}
PERSON_SUFFIX = ["m", "s", "t", "mos", "nt"]
ZL_OBJECT_PRONOUNS = {"me": "mek", "you": "tek", "him": "sek", "her": "sak", "us": "nek", "them": "vek"}
ZL_NUMBERS = ["du", "tri", "kwa", "pen", "ses", "sep", "ok", "nov", "dek"]
ZL_CONJUNCTIONS = {"and": "i", "but": "ma", "because": "kar"}
ZL_NEGATION = "ne"
ZL_RESERVED = set(ZL_OBJECT_PRONOUNS.values()) | set(ZL_NUMBERS) | set(ZL_CONJUNCTIONS.values()) | {ZL_NEGATION}

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "pl",
           "st", "tr", "sk", "ch", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "k", "m"]


def _make_stems(rng, count, taken, syllables):
    """`count` distinct invented stems (not in `taken`, which is updated)."""
    out = []
    while len(out) < count:
        n = syllables[rng.below(len(syllables))]
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
        if w not in taken and len(w) >= 3:
            taken.add(w)
            out.append(w)
    return out


class Lexicon:
    """The Zelan word for every English lemma, and each noun's gender; fixed by `seed`."""

    def __init__(self, seed=7):
        rng = SplitMix64(seed)
        taken = set(ZL_RESERVED)
        self.noun = dict(zip((s for s, _ in NOUNS), _make_stems(rng, len(NOUNS), taken, [2, 2, 3])))
        self.gender = {s: ("a" if rng.chance(0.5) else "b") for s, _ in NOUNS}
        verbs = [v[0] for v in VERBS_T + VERBS_I]
        self.verb = dict(zip(verbs, _make_stems(rng, len(verbs), taken, [1, 2, 2])))
        self.adj = dict(zip(ADJECTIVES, _make_stems(rng, len(ADJECTIVES), taken, [1, 2])))
        self.adv = dict(zip(ADVERBS, _make_stems(rng, len(ADVERBS), taken, [2, 3])))
        self.prep = dict(zip(PREPOSITIONS, _make_stems(rng, len(PREPOSITIONS), taken, [1])))


# ---- sentence generation ----------------------------------------------------------------------------
def _noun_phrase(rng, lex, as_object, allow_pronoun=True):
    """(english words, zelan words, person) of a random noun phrase."""
    if allow_pronoun and rng.chance(0.25):
        en, person = rng.choice(SUBJECT_PRONOUNS)
        if as_object:
            obj = OBJECT_PRONOUNS[en]
            return [obj], [ZL_OBJECT_PRONOUNS[obj]], person
        return [en], [], person  # Zelan drops subject pronouns: the verb ending carries the person
    noun_sg, noun_pl = rng.choice(NOUNS)
    gender = lex.gender[noun_sg]
    plural = rng.chance(0.4)
    number = None
    if plural:
        options = [d for d in DETERMINERS if d[1] is not None]
        det = rng.choice(options)
        if det[0] == "the" and rng.chance(0.4):
            number = rng.below(len(NUMBERS))
        elif rng.chance(0.15):
            det, number = None, rng.below(len(NUMBERS))
    else:
        det = rng.choice([d for d in DETERMINERS if d[0] is not None])
    n_adj = 0 if rng.chance(0.45) else (1 if rng.chance(0.7) else 2)
    adjs = []
    while len(adjs) < n_adj:
        a = rng.choice(ADJECTIVES)
        if a not in adjs:
            adjs.append(a)
    en = []
    if det is not None:
        en.append(det[1] if plural else det[0])
    if number is not None:
        en.append(NUMBERS[number])
    en += adjs
    en.append(noun_pl if plural else noun_sg)
    if en[0] == "a" and en[1][0] in "aeiou":
        en[0] = "an"
    zl = []
    if det is not None:
        zl.append(det[2] + DET_ENDING[(gender, plural, as_object)])
    zl.append(lex.noun[noun_sg] + (NOUN_PLURAL[gender] if plural else ""))
    zl += [lex.adj[a] + ADJ_ENDING[(gender, plural)] for a in adjs]
    if number is not None:
        zl.append(ZL_NUMBERS[number])
    return en, zl, (4 if plural else 2)


def _clause(rng, lex):
    """(english words, zelan words) of one clause."""
    s_en, s_zl, person = _noun_phrase(rng, lex, as_object=False)
    transitive = rng.chance(0.65)
    verb = rng.choice(VERBS_T if transitive else VERBS_I)
    tense = rng.choice(["present", "present", "past", "future"])
    negative = rng.chance(0.2)
    third_sg = person == 2
    if tense == "present":
        if negative:
            v_en = ["does" if third_sg else "do", "not", verb[0]]
        else:
            v_en = [verb[1] if third_sg else verb[0]]
    elif tense == "past":
        v_en = ["did", "not", verb[0]] if negative else [verb[2]]
    else:
        v_en = ["will", "not", verb[0]] if negative else ["will", verb[0]]
    o_en, o_zl = [], []
    if transitive:
        o_en, o_zl, _ = _noun_phrase(rng, lex, as_object=True)
    pp_en, pp_zl = [], []
    if rng.chance(0.35):
        prep = rng.choice(PREPOSITIONS)
        np_en, np_zl, _ = _noun_phrase(rng, lex, as_object=False, allow_pronoun=False)
        pp_en, pp_zl = [prep] + np_en, np_zl + [lex.prep[prep]]
    adv = rng.choice(ADVERBS) if rng.chance(0.25) else None
    v_zl = lex.verb[verb[0]] + TENSE_SUFFIX[tense] + PERSON_SUFFIX[person]
    en = s_en + v_en + o_en + pp_en + ([adv] if adv else [])
    zl = pp_zl + s_zl + o_zl + ([lex.adv[adv]] if adv else []) + ([ZL_NEGATION] if negative else []) + [v_zl]
    return en, zl


def _sentence(words):
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def generate_pairs(count, seed, lexicon=None, exclude=()):
    """`count` distinct (english, zelan) sentence pairs whose English side is not in `exclude`."""
    lex = lexicon or Lexicon()
    rng = SplitMix64(seed)
    seen = set(exclude)
    out = []
    while len(out) < count:
        en, zl = _clause(rng, lex)
        if rng.chance(0.15):
            en2, zl2 = _clause(rng, lex)
            conj = rng.choice(CONJUNCTIONS)
            en, zl = en + [conj] + en2, zl + [ZL_CONJUNCTIONS[conj]] + zl2
        src = _sentence(en)
        if src in seen:
            continue
        seen.add(src)
        out.append((src, _sentence(zl)))
    return out


# sizes of the built-in task; the seeds fix its content
TRANSLATION_SPLITS = (("train", 30000, 11), ("valid", 500, 12), ("test", 500, 13))
LM_SPLITS = (("train", 30000, 21), ("valid", 500, 22))


def _write_lines(path, lines):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)


def write_translation_corpus(out_dir, splits=TRANSLATION_SPLITS):
    """Write the built-in en→zl corpus to `out_dir` as `<split>.en` / `<split>.zl`; returns
    {split: (src_path, tgt_path)}. Splits never share a source sentence."""
    os.makedirs(out_dir, exist_ok=True)
    lex = Lexicon()
    paths, used = {}, set()
    for name, count, seed in splits:
        pairs = generate_pairs(count, seed, lex, exclude=used)
        used.update(src for src, _ in pairs)
        src_path, tgt_path = os.path.join(out_dir, f"{name}.en"), os.path.join(out_dir, f"{name}.zl")
        _write_lines(src_path, [s for s, _ in pairs])
        _write_lines(tgt_path, [t for _, t in pairs])
        paths[name] = (src_path, tgt_path)
    return paths


def write_lm_corpus(out_dir, splits=LM_SPLITS):
    """Write the built-in language-model corpus (English sentences of the same grammar) to `out_dir` as
    `lm.<split>.txt`; returns {split: path}."""
    os.makedirs(out_dir, exist_ok=True)
    lex = Lexicon()
    paths, used = {}, set()
    for name, count, seed in splits:
        pairs = generate_pairs(count, seed, lex, exclude=used)
        used.update(src for src, _ in pairs)
        path = os.path.join(out_dir, f"lm.{name}.txt")
        _write_lines(path, [s for s, _ in pairs])
        paths[name] = path
    return paths


def translation_splits(train_pairs):
    """The built-in task's splits with `train_pairs` training pairs (the same seeds: a larger corpus starts
    with the smaller one's training pairs; its valid and test sets avoid all of them)."""
    return tuple((name, train_pairs if name == "train" else count, seed) for name, count, seed in TRANSLATION_SPLITS)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write the built-in corpus files.")
    parser.add_argument("dir", nargs="?", default="builtin_data")
    parser.add_argument("--train-pairs", type=int, default=TRANSLATION_SPLITS[0][1],
                        help=f"training pairs of the translation corpus (default {TRANSLATION_SPLITS[0][1]})")
    parser.add_argument("--no-lm", action="store_true", help="only the translation corpus")
    args = parser.parse_args()
    if args.train_pairs < 1:
        parser.error(f"--train-pairs must be >= 1, got {args.train_pairs}")
    for split, files in write_translation_corpus(args.dir, translation_splits(args.train_pairs)).items():
        print(split, *files)
    if not args.no_lm:
        for split, path in write_lm_corpus(args.dir).items():
            print(split, path)
