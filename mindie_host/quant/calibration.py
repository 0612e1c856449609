"""The default calibration text of ``mindie-host quantize``: a few paragraphs of plain English prose,
conversation and code, written for this project, so that quantizing needs no download."""

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came back before sunrise, their decks stacked with crates,
and the market opened while the streets were still wet. A baker on the corner sold bread to the sailors,
who paid in coins and stories about the weather beyond the cape. Children ran to school along the sea wall,
counting the gulls, and the old lighthouse keeper climbed his stairs one more time to switch off the lamp.

User: Can you explain what a hash table is?
Assistant: A hash table stores pairs of keys and values. It runs each key through a hash function, which
turns the key into a number, and uses that number to pick a slot in an array. Looking up a key repeats the
same calculation, so on average it takes constant time. When two keys land in the same slot, the table
resolves the collision, for example by keeping a short list in each slot or by probing the next free one.

User: What is the capital of Japan, and what is it known for?
Assistant: The capital of Japan is Tokyo. It is known for its size, its efficient trains, its food,
from sushi counters to noodle shops, and for neighbourhoods that mix glass towers with quiet temples.

Photosynthesis is the process by which green plants turn light into chemical energy. Chlorophyll in the
leaves absorbs mostly red and blue light; the energy splits water into oxygen and hydrogen, and the plant
uses the hydrogen, together with carbon dioxide from the air, to build sugars. Those sugars feed the plant
and, through food chains, almost every other living thing on land.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]

for i, value in enumerate(fibonacci(10)):
    print(f"{i}: {value}")

In 1969 two astronauts walked on the Moon while a third orbited above them. The mission had taken years of
planning: engineers tested every valve, mathematicians checked every trajectory by hand and by computer,
and thousands of people built the rockets, suits and radios. The landing lasted less than a day, but the
rocks it brought back are still studied in laboratories around the world.

A good recipe for tomato soup needs ripe tomatoes, an onion, two cloves of garlic, olive oil, salt and a
little sugar. Soften the onion and garlic in the oil, add the chopped tomatoes, simmer for twenty minutes,
then blend until smooth. Season to taste and serve with warm bread and a spoon of cream.

User: Write a short poem about autumn.
Assistant: Red leaves drift down the quiet lane, / the orchard smells of apples and rain; / the days grow
short, the evenings cool, / and lanterns glow along the pool.

The theory of evolution explains how populations change over generations. Individuals vary, some
variations help them survive and reproduce, and those traits become more common. Over long periods the
accumulation of small changes can produce new species, which is why fossils show forms that no longer exist.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
GROUP BY name ORDER BY orders DESC LIMIT 10;

Numbers such as 3.14159, 2.71828, 1024, 65536 and 1,000,000 appear in science, computing and finance.
A budget of 2,500 euros split across twelve months leaves about 208 euros each month.
"""
