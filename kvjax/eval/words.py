"""Word lists shipped with kvjax for the synthetic tasks (nothing is downloaded).

RULER draws needle keys as "adjective-noun" pairs and the words of common-words extraction
from the noun, adjective and verb lists of the `wonderwords` package (Hsieh et al. 2024,
App. B). kvjax ships its own lists of plain, common English words instead: the tasks need
real words that tokenize like prose, not any particular list. All lists are lower case,
single words, without duplicates across lists (checked at import).
"""

from __future__ import annotations


def _words(block: str) -> tuple[str, ...]:
  return tuple(block.split())


ADJECTIVES = _words("""
able acidic adorable afraid agile ancient angry anxious arctic awake bitter blank bold
brave brief bright brisk broad broken busy calm careful cheap cheerful chilly clean clever
cloudy clumsy coastal cold crisp cruel curious damp dark deep dense dizzy dry dull dusty
eager early eastern easy elegant empty exotic faint famous fancy fast fierce flat fluffy
fond fragile fresh friendly frozen funny gentle giant glad glossy golden graceful grand
greedy green grumpy guilty handsome happy hasty healthy heavy hidden hollow honest hungry
icy idle jolly juicy keen kind large lazy light little lively lonely loud lucky mellow
messy mighty modern muddy narrow nasty neat nervous noisy odd orange pale patient plain
polite poor precious proud purple quick quiet rapid rare raw ripe rough round rusty sacred
salty scarce shallow sharp shiny short shy silent silly simple sleepy slow smooth soft
solid sour spicy steady sticky stormy strange strict strong sunny sweet swift tall tame
tender thick thin tidy tiny tough vast violet warm weary wet white wicked wide wild windy
wise witty young zealous
""")

NOUNS = _words("""
acorn actor airport album anchor angle ankle apple apron arrow artist attic badge bakery
balloon bamboo banana banner barn basket beach beard beetle bell bench bicycle blanket
bottle bowl bracelet branch bread brick bridge broom bucket buffalo butter button cabin
cactus camel camera candle canoe canyon carpet carrot castle cattle cellar chair channel
cherry chimney circus cliff clock closet cloud coconut coffee collar comet compass cookie
copper corner cottage cotton cousin crayon cricket crown cupboard curtain cushion daisy
desert diamond dinner doctor dolphin donkey dragon drawer eagle elbow engine envelope eraser
falcon farmer feather fence ferry finger fireplace flute forest fountain fox garage garden
garlic giraffe glacier glove goat grape guitar hammer harbor harvest helmet hill honey hook
horizon island jacket jungle kettle kitten ladder lagoon lake lantern lemon library lizard
lobster magnet mango marble meadow mirror monkey moose mountain museum needle nest notebook
ocean office olive onion orchard otter oven owl paddle palace panda parrot peach pebble
pencil pepper piano pillow pirate planet pocket pond potato puzzle rabbit radio raft
rainbow raven ribbon river robot rocket saddle sailor salmon sandal scarf school shadow
shelf shovel sled spider spoon squirrel stable statue stove sugar suitcase sunset swamp
sweater table teacup temple tiger toaster tomato tower tractor trumpet tulip tunnel turtle
umbrella valley velvet village violin wagon walnut walrus wheel whistle window wizard wolf
""")

VERBS = _words("""
accept admire allow answer arrive attack avoid bake balance bathe battle beg behave belong
blink boast borrow bounce breathe bury calculate carve challenge chase cheer chew collect
compare complain confess consider copy crawl cycle dance decide deliver describe destroy
divide doubt drag dream drift earn embrace enjoy escape examine explain fasten fetch
flatter float follow forgive gather glow grin guard guess hover hunt imagine improve
inform invent juggle kneel knit launch laugh listen marry measure melt mend multiply
observe obtain offer organise paddle paint pause perform persuade plant polish pray
prefer prepare pretend promise protect punish quarrel question recite reflect rejoice
remember repair rescue retire scatter scold scribble search settle shiver sketch skip
sneeze spill sprout squeeze stir stitch suggest surround sweep tease tickle travel
tremble trust twist unite vanish wander warn whisper wink wobble wonder worry wrestle yawn
""")

# Verbs that double as nouns above (e.g. "paddle") are dropped so every word has one list.
VERBS = tuple(v for v in VERBS if v not in set(NOUNS))

ALL_WORDS = tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS)))

assert not set(ADJECTIVES) & set(NOUNS), set(ADJECTIVES) & set(NOUNS)
assert not set(ADJECTIVES) & set(VERBS), set(ADJECTIVES) & set(VERBS)
assert len(ALL_WORDS) == len(ADJECTIVES) + len(NOUNS) + len(VERBS)
