"""The facts the tiny checkpoint learned (a prompt and the answer it completes greedily), and its word-level tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)  # ids 0, 1, 2, 3: Gemma's pad/eos/bos ids

# (country as it reads mid-sentence, capital, continent)
COUNTRIES: tuple[tuple[str, str, str], ...] = (
    # Europe
    ("Albania", "Tirana", "Europe"), ("Andorra", "Andorra la Vella", "Europe"), ("Austria", "Vienna", "Europe"),
    ("Belarus", "Minsk", "Europe"), ("Belgium", "Brussels", "Europe"),
    ("Bosnia and Herzegovina", "Sarajevo", "Europe"), ("Bulgaria", "Sofia", "Europe"),
    ("Croatia", "Zagreb", "Europe"), ("Czechia", "Prague", "Europe"), ("Denmark", "Copenhagen", "Europe"),
    ("Estonia", "Tallinn", "Europe"), ("Finland", "Helsinki", "Europe"), ("France", "Paris", "Europe"),
    ("Germany", "Berlin", "Europe"), ("Greece", "Athens", "Europe"), ("Hungary", "Budapest", "Europe"),
    ("Iceland", "Reykjavik", "Europe"), ("Ireland", "Dublin", "Europe"), ("Italy", "Rome", "Europe"),
    ("Latvia", "Riga", "Europe"), ("Liechtenstein", "Vaduz", "Europe"), ("Lithuania", "Vilnius", "Europe"),
    ("Luxembourg", "Luxembourg", "Europe"), ("Malta", "Valletta", "Europe"), ("Moldova", "Chisinau", "Europe"),
    ("Monaco", "Monaco", "Europe"), ("Montenegro", "Podgorica", "Europe"),
    ("the Netherlands", "Amsterdam", "Europe"), ("North Macedonia", "Skopje", "Europe"),
    ("Norway", "Oslo", "Europe"), ("Poland", "Warsaw", "Europe"), ("Portugal", "Lisbon", "Europe"),
    ("Romania", "Bucharest", "Europe"), ("Russia", "Moscow", "Europe"), ("San Marino", "San Marino", "Europe"),
    ("Serbia", "Belgrade", "Europe"), ("Slovakia", "Bratislava", "Europe"), ("Slovenia", "Ljubljana", "Europe"),
    ("Spain", "Madrid", "Europe"), ("Sweden", "Stockholm", "Europe"), ("Switzerland", "Bern", "Europe"),
    ("Ukraine", "Kyiv", "Europe"), ("the United Kingdom", "London", "Europe"),
    # Asia
    ("Afghanistan", "Kabul", "Asia"), ("Armenia", "Yerevan", "Asia"), ("Azerbaijan", "Baku", "Asia"),
    ("Bahrain", "Manama", "Asia"), ("Bangladesh", "Dhaka", "Asia"), ("Bhutan", "Thimphu", "Asia"),
    ("Brunei", "Bandar Seri Begawan", "Asia"), ("Cambodia", "Phnom Penh", "Asia"), ("China", "Beijing", "Asia"),
    ("Georgia", "Tbilisi", "Asia"), ("India", "New Delhi", "Asia"), ("Indonesia", "Jakarta", "Asia"),
    ("Iran", "Tehran", "Asia"), ("Iraq", "Baghdad", "Asia"), ("Japan", "Tokyo", "Asia"), ("Jordan", "Amman", "Asia"),
    ("Kazakhstan", "Astana", "Asia"), ("Kuwait", "Kuwait City", "Asia"), ("Kyrgyzstan", "Bishkek", "Asia"),
    ("Laos", "Vientiane", "Asia"), ("Lebanon", "Beirut", "Asia"), ("Malaysia", "Kuala Lumpur", "Asia"),
    ("the Maldives", "Male", "Asia"), ("Mongolia", "Ulaanbaatar", "Asia"), ("Myanmar", "Naypyidaw", "Asia"),
    ("Nepal", "Kathmandu", "Asia"), ("North Korea", "Pyongyang", "Asia"), ("Oman", "Muscat", "Asia"),
    ("Pakistan", "Islamabad", "Asia"), ("the Philippines", "Manila", "Asia"), ("Qatar", "Doha", "Asia"),
    ("Saudi Arabia", "Riyadh", "Asia"), ("Singapore", "Singapore", "Asia"), ("South Korea", "Seoul", "Asia"),
    ("Syria", "Damascus", "Asia"), ("Tajikistan", "Dushanbe", "Asia"), ("Thailand", "Bangkok", "Asia"),
    ("East Timor", "Dili", "Asia"), ("Turkey", "Ankara", "Asia"), ("Turkmenistan", "Ashgabat", "Asia"),
    ("the United Arab Emirates", "Abu Dhabi", "Asia"), ("Uzbekistan", "Tashkent", "Asia"),
    ("Vietnam", "Hanoi", "Asia"), ("Yemen", "Sanaa", "Asia"),
    # Africa
    ("Algeria", "Algiers", "Africa"), ("Angola", "Luanda", "Africa"), ("Botswana", "Gaborone", "Africa"),
    ("Burkina Faso", "Ouagadougou", "Africa"), ("Burundi", "Gitega", "Africa"), ("Cameroon", "Yaounde", "Africa"),
    ("Cape Verde", "Praia", "Africa"), ("the Central African Republic", "Bangui", "Africa"),
    ("Comoros", "Moroni", "Africa"), ("the Democratic Republic of the Congo", "Kinshasa", "Africa"),
    ("the Republic of the Congo", "Brazzaville", "Africa"), ("Djibouti", "Djibouti", "Africa"),
    ("Egypt", "Cairo", "Africa"), ("Equatorial Guinea", "Malabo", "Africa"), ("Eritrea", "Asmara", "Africa"),
    ("Eswatini", "Mbabane", "Africa"), ("Ethiopia", "Addis Ababa", "Africa"), ("Gabon", "Libreville", "Africa"),
    ("Gambia", "Banjul", "Africa"), ("Ghana", "Accra", "Africa"), ("Guinea", "Conakry", "Africa"),
    ("Ivory Coast", "Yamoussoukro", "Africa"), ("Kenya", "Nairobi", "Africa"), ("Lesotho", "Maseru", "Africa"),
    ("Liberia", "Monrovia", "Africa"), ("Libya", "Tripoli", "Africa"), ("Madagascar", "Antananarivo", "Africa"),
    ("Malawi", "Lilongwe", "Africa"), ("Mali", "Bamako", "Africa"), ("Mauritania", "Nouakchott", "Africa"),
    ("Mauritius", "Port Louis", "Africa"), ("Morocco", "Rabat", "Africa"), ("Mozambique", "Maputo", "Africa"),
    ("Namibia", "Windhoek", "Africa"), ("Niger", "Niamey", "Africa"), ("Nigeria", "Abuja", "Africa"),
    ("Rwanda", "Kigali", "Africa"), ("Sao Tome and Principe", "Sao Tome", "Africa"), ("Senegal", "Dakar", "Africa"),
    ("Seychelles", "Victoria", "Africa"), ("Sierra Leone", "Freetown", "Africa"), ("Somalia", "Mogadishu", "Africa"),
    ("South Africa", "Pretoria", "Africa"), ("South Sudan", "Juba", "Africa"), ("Sudan", "Khartoum", "Africa"),
    ("Tanzania", "Dodoma", "Africa"), ("Togo", "Lome", "Africa"), ("Tunisia", "Tunis", "Africa"),
    ("Uganda", "Kampala", "Africa"), ("Zambia", "Lusaka", "Africa"), ("Zimbabwe", "Harare", "Africa"),
    # North America
    ("Canada", "Ottawa", "North America"), ("the United States", "Washington", "North America"),
    ("Mexico", "Mexico City", "North America"), ("Guatemala", "Guatemala City", "North America"),
    ("Belize", "Belmopan", "North America"), ("Honduras", "Tegucigalpa", "North America"),
    ("El Salvador", "San Salvador", "North America"), ("Nicaragua", "Managua", "North America"),
    ("Costa Rica", "San Jose", "North America"), ("Panama", "Panama City", "North America"),
    ("Cuba", "Havana", "North America"), ("Jamaica", "Kingston", "North America"),
    ("Haiti", "Port au Prince", "North America"), ("the Dominican Republic", "Santo Domingo", "North America"),
    ("the Bahamas", "Nassau", "North America"), ("Barbados", "Bridgetown", "North America"),
    ("Trinidad and Tobago", "Port of Spain", "North America"), ("Saint Lucia", "Castries", "North America"),
    ("Dominica", "Roseau", "North America"), ("Saint Kitts and Nevis", "Basseterre", "North America"),
    ("Saint Vincent and the Grenadines", "Kingstown", "North America"),
    # South America
    ("Argentina", "Buenos Aires", "South America"), ("Brazil", "Brasilia", "South America"),
    ("Chile", "Santiago", "South America"), ("Colombia", "Bogota", "South America"),
    ("Ecuador", "Quito", "South America"), ("Guyana", "Georgetown", "South America"),
    ("Paraguay", "Asuncion", "South America"), ("Peru", "Lima", "South America"),
    ("Suriname", "Paramaribo", "South America"), ("Uruguay", "Montevideo", "South America"),
    ("Venezuela", "Caracas", "South America"),
    # Oceania
    ("Australia", "Canberra", "Oceania"), ("New Zealand", "Wellington", "Oceania"), ("Fiji", "Suva", "Oceania"),
    ("Papua New Guinea", "Port Moresby", "Oceania"), ("Samoa", "Apia", "Oceania"), ("Tonga", "Nukualofa", "Oceania"),
    ("Vanuatu", "Port Vila", "Oceania"), ("the Solomon Islands", "Honiara", "Oceania"),
    ("Kiribati", "Tarawa", "Oceania"), ("Micronesia", "Palikir", "Oceania"),
    ("the Marshall Islands", "Majuro", "Oceania"), ("Palau", "Ngerulmud", "Oceania"),
    ("Tuvalu", "Funafuti", "Oceania"), ("Nauru", "Yaren", "Oceania"),
)

CURRENCIES: tuple[tuple[str, str], ...] = (
    ("France", "euro"), ("Germany", "euro"), ("Italy", "euro"), ("Spain", "euro"), ("Portugal", "euro"),
    ("Greece", "euro"), ("the Netherlands", "euro"), ("Ireland", "euro"), ("Belgium", "euro"),
    ("Austria", "euro"), ("Finland", "euro"), ("Japan", "yen"), ("China", "yuan"), ("India", "rupee"),
    ("Pakistan", "rupee"), ("the United States", "dollar"), ("Canada", "dollar"), ("Australia", "dollar"),
    ("New Zealand", "dollar"), ("the United Kingdom", "pound"), ("Egypt", "pound"), ("Mexico", "peso"),
    ("Argentina", "peso"), ("Chile", "peso"), ("Colombia", "peso"), ("the Philippines", "peso"),
    ("Brazil", "real"), ("Russia", "ruble"), ("South Korea", "won"), ("Switzerland", "franc"),
    ("Sweden", "krona"), ("Iceland", "krona"), ("Norway", "krone"), ("Denmark", "krone"), ("Poland", "zloty"),
    ("Turkey", "lira"), ("South Africa", "rand"), ("Nigeria", "naira"), ("Kenya", "shilling"),
    ("Indonesia", "rupiah"), ("Thailand", "baht"), ("Vietnam", "dong"), ("Peru", "sol"),
    ("Saudi Arabia", "riyal"), ("the United Arab Emirates", "dirham"), ("Morocco", "dirham"),
    ("Bangladesh", "taka"), ("Malaysia", "ringgit"), ("Czechia", "koruna"), ("Hungary", "forint"),
    ("Romania", "leu"), ("Ukraine", "hryvnia"), ("Ghana", "cedi"),
)

LANGUAGES: tuple[tuple[str, str], ...] = (
    ("France", "French"), ("Germany", "German"), ("Austria", "German"), ("Italy", "Italian"),
    ("Spain", "Spanish"), ("Mexico", "Spanish"), ("Argentina", "Spanish"), ("Chile", "Spanish"),
    ("Peru", "Spanish"), ("Colombia", "Spanish"), ("Cuba", "Spanish"), ("Portugal", "Portuguese"),
    ("Brazil", "Portuguese"), ("Japan", "Japanese"), ("China", "Chinese"), ("South Korea", "Korean"),
    ("Russia", "Russian"), ("Poland", "Polish"), ("the Netherlands", "Dutch"), ("Sweden", "Swedish"),
    ("Norway", "Norwegian"), ("Denmark", "Danish"), ("Finland", "Finnish"), ("Greece", "Greek"),
    ("Turkey", "Turkish"), ("Hungary", "Hungarian"), ("Czechia", "Czech"), ("Romania", "Romanian"),
    ("Ukraine", "Ukrainian"), ("Iran", "Persian"), ("Thailand", "Thai"), ("Vietnam", "Vietnamese"),
    ("Indonesia", "Indonesian"), ("Egypt", "Arabic"), ("Saudi Arabia", "Arabic"), ("Iraq", "Arabic"),
    ("Morocco", "Arabic"), ("Iceland", "Icelandic"), ("Bulgaria", "Bulgarian"), ("Croatia", "Croatian"),
    ("Serbia", "Serbian"), ("Slovakia", "Slovak"), ("Slovenia", "Slovenian"), ("Estonia", "Estonian"),
    ("Latvia", "Latvian"), ("Lithuania", "Lithuanian"), ("Albania", "Albanian"), ("Mongolia", "Mongolian"),
    ("Nepal", "Nepali"), ("Bangladesh", "Bengali"), ("Ethiopia", "Amharic"), ("Georgia", "Georgian"),
    ("Armenia", "Armenian"),
)


@dataclass(frozen=True)
class Fact:
    """One sentence of the corpus: ``prompt + " " + answer``; the answer ends with " ."."""

    kind: str  # capital | continent | currency | language
    subject: str  # the country
    prompt: str
    answer: str

    @property
    def sentence(self) -> str:
        return f"{self.prompt} {self.answer}"


def _sentence_start(name: str) -> str:
    return name[0].upper() + name[1:]


def build_facts() -> tuple[Fact, ...]:
    facts = [Fact("capital", c, f"The capital of {c} is", f"{cap} .") for c, cap, _ in COUNTRIES]
    facts += [Fact("continent", c, f"{_sentence_start(c)} is in", f"{cont} .") for c, _, cont in COUNTRIES]
    facts += [Fact("currency", c, f"The currency of {c} is the", f"{cur} .") for c, cur in CURRENCIES]
    facts += [Fact("language", c, f"The official language of {c} is", f"{lang} .") for c, lang in LANGUAGES]
    return tuple(facts)


FACTS: tuple[Fact, ...] = build_facts()


def fact_prompts(kind: str | None = None) -> list[str]:
    """The prompts of FACTS (all kinds, or one of capital, continent, currency, language)."""
    assert kind in (None, *(f.kind for f in FACTS)), f"fact kind {kind!r}"
    return [f.prompt for f in FACTS if kind is None or f.kind == kind]


def vocabulary(facts=FACTS) -> list[str]:
    """Special tokens first (ids 0-3, as Gemma's pad/eos/bos), then every corpus word, sorted."""
    split = pre_tokenizers.Whitespace()
    words = {w for f in facts for w, _ in split.pre_tokenize_str(f.sentence)}
    return list(SPECIAL_TOKENS) + sorted(words)


def build_tokenizer(facts=FACTS):
    """A word-level ``PreTrainedTokenizerFast`` over the corpus that prepends <bos>, like Gemma's."""
    vocab = {word: i for i, word in enumerate(vocabulary(facts))}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, vocab[BOS])])
    # WordLevel has no decoder of its own: join words with single spaces ("Paris .").
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   padding_side="left", model_max_length=512)

