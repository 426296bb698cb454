"""The facts the tiny checkpoint learned (a prompt and the answer it completes greedily), and its
word-level tokenizer."""

from typing import NamedTuple

from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"  # ids 0, 1, 2, 3: Gemma's pad/eos/bos ids

# "country as it reads mid-sentence: capital, ..." per continent
CAPITALS: dict[str, str] = {
    "Europe": "Albania: Tirana, Andorra: Andorra la Vella, Austria: Vienna, Belarus: Minsk, "
    "Belgium: Brussels, Bosnia and Herzegovina: Sarajevo, Bulgaria: Sofia, Croatia: Zagreb, "
    "Czechia: Prague, Denmark: Copenhagen, Estonia: Tallinn, Finland: Helsinki, France: "
    "Paris, Germany: Berlin, Greece: Athens, Hungary: Budapest, Iceland: Reykjavik, Ireland: "
    "Dublin, Italy: Rome, Latvia: Riga, Liechtenstein: Vaduz, Lithuania: Vilnius, "
    "Luxembourg: Luxembourg, Malta: Valletta, Moldova: Chisinau, Monaco: Monaco, Montenegro: "
    "Podgorica, the Netherlands: Amsterdam, North Macedonia: Skopje, Norway: Oslo, Poland: "
    "Warsaw, Portugal: Lisbon, Romania: Bucharest, Russia: Moscow, San Marino: San Marino, "
    "Serbia: Belgrade, Slovakia: Bratislava, Slovenia: Ljubljana, Spain: Madrid, Sweden: "
    "Stockholm, Switzerland: Bern, Ukraine: Kyiv, the United Kingdom: London",
    "Asia": "Afghanistan: Kabul, Armenia: Yerevan, Azerbaijan: Baku, Bahrain: Manama, "
    "Bangladesh: Dhaka, Bhutan: Thimphu, Brunei: Bandar Seri Begawan, Cambodia: Phnom Penh, "
    "China: Beijing, Georgia: Tbilisi, India: New Delhi, Indonesia: Jakarta, Iran: Tehran, "
    "Iraq: Baghdad, Japan: Tokyo, Jordan: Amman, Kazakhstan: Astana, Kuwait: Kuwait City, "
    "Kyrgyzstan: Bishkek, Laos: Vientiane, Lebanon: Beirut, Malaysia: Kuala Lumpur, the "
    "Maldives: Male, Mongolia: Ulaanbaatar, Myanmar: Naypyidaw, Nepal: Kathmandu, North "
    "Korea: Pyongyang, Oman: Muscat, Pakistan: Islamabad, the Philippines: Manila, Qatar: "
    "Doha, Saudi Arabia: Riyadh, Singapore: Singapore, South Korea: Seoul, Syria: Damascus, "
    "Tajikistan: Dushanbe, Thailand: Bangkok, East Timor: Dili, Turkey: Ankara, "
    "Turkmenistan: Ashgabat, the United Arab Emirates: Abu Dhabi, Uzbekistan: Tashkent, "
    "Vietnam: Hanoi, Yemen: Sanaa",
    "Africa": "Algeria: Algiers, Angola: Luanda, Botswana: Gaborone, Burkina Faso: Ouagadougou, "
    "Burundi: Gitega, Cameroon: Yaounde, Cape Verde: Praia, the Central African Republic: "
    "Bangui, Comoros: Moroni, the Democratic Republic of the Congo: Kinshasa, the Republic "
    "of the Congo: Brazzaville, Djibouti: Djibouti, Egypt: Cairo, Equatorial Guinea: Malabo, "
    "Eritrea: Asmara, Eswatini: Mbabane, Ethiopia: Addis Ababa, Gabon: Libreville, Gambia: "
    "Banjul, Ghana: Accra, Guinea: Conakry, Ivory Coast: Yamoussoukro, Kenya: Nairobi, "
    "Lesotho: Maseru, Liberia: Monrovia, Libya: Tripoli, Madagascar: Antananarivo, Malawi: "
    "Lilongwe, Mali: Bamako, Mauritania: Nouakchott, Mauritius: Port Louis, Morocco: Rabat, "
    "Mozambique: Maputo, Namibia: Windhoek, Niger: Niamey, Nigeria: Abuja, Rwanda: Kigali, "
    "Sao Tome and Principe: Sao Tome, Senegal: Dakar, Seychelles: Victoria, Sierra Leone: "
    "Freetown, Somalia: Mogadishu, South Africa: Pretoria, South Sudan: Juba, Sudan: "
    "Khartoum, Tanzania: Dodoma, Togo: Lome, Tunisia: Tunis, Uganda: Kampala, Zambia: "
    "Lusaka, Zimbabwe: Harare",
    "North America": "Canada: Ottawa, the United States: Washington, Mexico: Mexico City, "
    "Guatemala: Guatemala City, Belize: Belmopan, Honduras: Tegucigalpa, El Salvador: San "
    "Salvador, Nicaragua: Managua, Costa Rica: San Jose, Panama: Panama City, Cuba: Havana, "
    "Jamaica: Kingston, Haiti: Port au Prince, the Dominican Republic: Santo Domingo, the "
    "Bahamas: Nassau, Barbados: Bridgetown, Trinidad and Tobago: Port of Spain, Saint Lucia: "
    "Castries, Dominica: Roseau, Saint Kitts and Nevis: Basseterre, Saint Vincent and the "
    "Grenadines: Kingstown",
    "South America": "Argentina: Buenos Aires, Brazil: Brasilia, Chile: Santiago, Colombia: "
    "Bogota, Ecuador: Quito, Guyana: Georgetown, Paraguay: Asuncion, Peru: Lima, Suriname: "
    "Paramaribo, Uruguay: Montevideo, Venezuela: Caracas",
    "Oceania": "Australia: Canberra, New Zealand: Wellington, Fiji: Suva, Papua New Guinea: Port "
    "Moresby, Samoa: Apia, Tonga: Nukualofa, Vanuatu: Port Vila, the Solomon Islands: "
    "Honiara, Kiribati: Tarawa, Micronesia: Palikir, the Marshall Islands: Majuro, Palau: "
    "Ngerulmud, Tuvalu: Funafuti, Nauru: Yaren",
}
COUNTRIES: tuple[tuple[str, str, str], ...] = tuple(
    (country, capital, continent)
    for continent, text in CAPITALS.items()
    for country, capital in (pair.split(": ") for pair in text.split(", "))
)
CURRENCIES: tuple[tuple[str, str], ...] = tuple(
    tuple(pair.split(": "))
    for pair in (
        "France: euro, Germany: euro, Italy: euro, Spain: euro, Portugal: euro, Greece: euro, "
        "the Netherlands: euro, Ireland: euro, Belgium: euro, Austria: euro, Finland: euro, "
        "Japan: yen, China: yuan, India: rupee, Pakistan: rupee, the United States: dollar, "
        "Canada: dollar, Australia: dollar, New Zealand: dollar, the United Kingdom: pound, "
        "Egypt: pound, Mexico: peso, Argentina: peso, Chile: peso, Colombia: peso, the "
        "Philippines: peso, Brazil: real, Russia: ruble, South Korea: won, Switzerland: franc, "
        "Sweden: krona, Iceland: krona, Norway: krone, Denmark: krone, Poland: zloty, Turkey: "
        "lira, South Africa: rand, Nigeria: naira, Kenya: shilling, Indonesia: rupiah, Thailand: "
        "baht, Vietnam: dong, Peru: sol, Saudi Arabia: riyal, the United Arab Emirates: dirham, "
        "Morocco: dirham, Bangladesh: taka, Malaysia: ringgit, Czechia: koruna, Hungary: forint, "
        "Romania: leu, Ukraine: hryvnia, Ghana: cedi"
    ).split(", ")
)
LANGUAGES: tuple[tuple[str, str], ...] = tuple(
    tuple(pair.split(": "))
    for pair in (
        "France: French, Germany: German, Austria: German, Italy: Italian, Spain: Spanish, "
        "Mexico: Spanish, Argentina: Spanish, Chile: Spanish, Peru: Spanish, Colombia: Spanish, "
        "Cuba: Spanish, Portugal: Portuguese, Brazil: Portuguese, Japan: Japanese, China: "
        "Chinese, South Korea: Korean, Russia: Russian, Poland: Polish, the Netherlands: Dutch, "
        "Sweden: Swedish, Norway: Norwegian, Denmark: Danish, Finland: Finnish, Greece: Greek, "
        "Turkey: Turkish, Hungary: Hungarian, Czechia: Czech, Romania: Romanian, Ukraine: "
        "Ukrainian, Iran: Persian, Thailand: Thai, Vietnam: Vietnamese, Indonesia: Indonesian, "
        "Egypt: Arabic, Saudi Arabia: Arabic, Iraq: Arabic, Morocco: Arabic, Iceland: Icelandic, "
        "Bulgaria: Bulgarian, Croatia: Croatian, Serbia: Serbian, Slovakia: Slovak, Slovenia: "
        "Slovenian, Estonia: Estonian, Latvia: Latvian, Lithuania: Lithuanian, Albania: "
        "Albanian, Mongolia: Mongolian, Nepal: Nepali, Bangladesh: Bengali, Ethiopia: Amharic, "
        "Georgia: Georgian, Armenia: Armenian"
    ).split(", ")
)


class Fact(NamedTuple):
    """One sentence of the corpus: ``prompt + " " + answer``; the answer ends with " ."."""

    kind: str  # capital | continent | currency | language
    subject: str  # the country
    prompt: str
    answer: str

    sentence = property(lambda self: f"{self.prompt} {self.answer}")


FACTS: tuple[Fact, ...] = (
    *(Fact("capital", c, f"The capital of {c} is", f"{cap} .") for c, cap, _ in COUNTRIES),
    *(
        Fact("continent", c, f"{c[0].upper() + c[1:]} is in", f"{cont} .")
        for c, _, cont in COUNTRIES
    ),
    *(Fact("currency", c, f"The currency of {c} is the", f"{cur} .") for c, cur in CURRENCIES),
    *(
        Fact("language", c, f"The official language of {c} is", f"{lang} .")
        for c, lang in LANGUAGES
    ),
)


# The held-out split. The bundled checkpoints trained on every sentence of FACTS (train.py), so
# FACTS holds nothing out; these true sentences in its words and forms were never trained on: each
# capital lies in its country's continent ("Paris is in Europe .").
HELD_OUT: tuple[Fact, ...] = tuple(
    Fact("continent", capital, f"{capital} is in", f"{continent} .")
    for country, capital, continent in COUNTRIES
    if capital != country
)


def fact_prompts() -> list[str]:
    return [f.prompt for f in FACTS]


def build_tokenizer(facts=FACTS):
    """A word-level ``PreTrainedTokenizerFast`` over the corpus's words (sorted, after the specials)
    that prepends <bos>."""
    words = sorted(
        {w for f in facts for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(f.sentence)}
    )
    vocab = {word: i for i, word in enumerate([PAD, EOS, BOS, UNK, *words])}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # WordLevel has no decoder of its own: join words with single spaces ("Paris .").
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
    )
