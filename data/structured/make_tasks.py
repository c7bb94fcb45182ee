"""Writes tasks.jsonl: the structured-output workload (issue 35), written here by hand.

Each line: {"id", "kind", "prompt", "guide_type", "guide", "max_tokens"} where guide is a
JSON schema (kind extraction, tool_call, classification) or a regex (kind format), and
max_tokens (160) leaves room for every schema to complete (free-text fields carry a
maxLength, as production tool schemas do, so a rambling model cannot run past it). Run:
    python data/structured/make_tasks.py
The schemas are small and strict (additionalProperties false, every field required), the
shape of production extraction and tool calls."""
from __future__ import annotations

import json
from pathlib import Path

MAX_TOKENS = 160
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "currency", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "date": {"type": "string"},
                                          "location": {"type": "string"}, "attendees": {"type": "integer"}},
         "required": ["event", "date", "location", "attendees"], "additionalProperties": False}

EXTRACTION = [
    (PERSON, "Maria is 34 years old and lives in Lisbon."),
    (PERSON, "Our new colleague, Kenji Tanaka, 41, moved here from Osaka."),
    (PERSON, "Aisha (age 27) works remotely from Nairobi."),
    (PERSON, "The winner, 19-year-old Lucas Silva of Porto, thanked his coach."),
    (PERSON, "Grandpa Joe turned 88 last week in Dublin."),
    (PERSON, "Priya Patel, a 52 year old engineer, is based in Pune."),
    (PERSON, "Tom lives in Chicago. He is 45."),
    (PERSON, "Meet Sofia, 23, a student in Madrid."),
    (PRODUCT, "The UltraBook 14 laptop costs $1299 and is currently available."),
    (PRODUCT, "Sorry, the Trailblazer backpack (89.99 EUR) is sold out."),
    (PRODUCT, "Wireless earbuds: 59 GBP, in stock, ships tomorrow."),
    (PRODUCT, "The espresso machine is back in stock at 349 dollars."),
    (PRODUCT, "Running shoes, 120 euros, out of stock until May."),
    (PRODUCT, "A 4K monitor for 279.50 USD; three units left."),
    (EVENT, "The annual robotics fair takes place on 2025-03-14 in Berlin with about 800 visitors."),
    (EVENT, "Join 40 colleagues for the team offsite in Lisbon on June 2nd, 2025."),
    (EVENT, "The jazz night at Blue Hall on Friday 12 September drew 150 people."),
    (EVENT, "Our book club meets on 2025-01-08 at the city library; 12 members are coming."),
    (EVENT, "The marathon on April 21 in Boston expects 30000 runners."),
    (EVENT, "A startup pitch evening in Austin, 2025-05-30, for 200 guests."),
]

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "book_flight": {"type": "object", "properties": {
        "name": {"const": "book_flight"},
        "arguments": {"type": "object", "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                                                       "date": {"type": "string"}, "passengers": {"type": "integer"}},
                      "required": ["origin", "destination", "date", "passengers"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "send_email": {"type": "object", "properties": {
        "name": {"const": "send_email"},
        "arguments": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 60},
                                                       "subject": {"type": "string", "maxLength": 80},
                                                       "body": {"type": "string", "maxLength": 200}},
                      "required": ["to", "subject", "body"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "create_reminder": {"type": "object", "properties": {
        "name": {"const": "create_reminder"},
        "arguments": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 100},
                                                       "time": {"type": "string", "maxLength": 40}},
                      "required": ["text", "time"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
}
TOOL_CALLS = [
    ("get_weather", "What's the weather like in Paris today? Use celsius."),
    ("get_weather", "Is it hot in Phoenix right now? Fahrenheit please."),
    ("get_weather", "Tell me the temperature in Oslo."),
    ("get_weather", "Weather for Tokyo, in fahrenheit."),
    ("book_flight", "Book a flight from London to New York on 2025-07-01 for 2 people."),
    ("book_flight", "I need one seat from Madrid to Rome on August 3rd."),
    ("book_flight", "Get 4 tickets Sydney to Auckland, December 20."),
    ("book_flight", "Fly me from Boston to Denver next Monday, just me."),
    ("send_email", "Email bob@example.com that the meeting moved to 3pm."),
    ("send_email", "Send an email to hr@company.org asking about my vacation days."),
    ("send_email", "Write to anna@example.net to thank her for the gift."),
    ("send_email", "Let support@shop.com know my order arrived damaged."),
    ("create_reminder", "Remind me to call mom at 6pm."),
    ("create_reminder", "Set a reminder for tomorrow 9am: dentist appointment."),
    ("create_reminder", "Remind me to water the plants on Sunday morning."),
]

SENTIMENT = {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
             "required": ["sentiment"], "additionalProperties": False}
TOPIC = {"type": "object", "properties": {"topic": {"type": "string", "enum": ["sports", "politics", "technology",
                                                                                "health", "business"]},
                                          "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
         "required": ["topic", "confidence"], "additionalProperties": False}
CLASSIFICATION = [
    (SENTIMENT, "Review: The battery lasts forever and the screen is gorgeous."),
    (SENTIMENT, "Review: It broke after two days. Total waste of money."),
    (SENTIMENT, "Review: The package arrived on Tuesday."),
    (SENTIMENT, "Review: Best pizza in town, friendly staff!"),
    (SENTIMENT, "Review: The hotel room was dirty and noisy."),
    (SENTIMENT, "Review: It does what it says, nothing more."),
    (TOPIC, "Headline: Local team wins the championship after extra time."),
    (TOPIC, "Headline: New smartphone chip doubles battery life."),
    (TOPIC, "Headline: Parliament passes the budget after long debate."),
    (TOPIC, "Headline: Study links daily walks to better sleep."),
    (TOPIC, "Headline: Shares of the retailer jump 12% on strong earnings."),
    (TOPIC, "Headline: Open-source AI model tops the benchmark charts."),
]

FORMATS = [
    (r"\d{4}-\d{2}-\d{2}", "What is the date of the first Moon landing? Answer as YYYY-MM-DD."),
    (r"(yes|no)", "Is water wet? Answer yes or no."),
    (r"[A-Z][a-z]+", "What is the capital of France? One word."),
    (r"\(\d{3}\) \d{3}-\d{4}", "Make up a US phone number."),
    (r"#[0-9a-f]{6}", "Give the hex color code for pure red."),
    (r"\d+", "How many legs does a spider have? Just the number."),
]


def tasks() -> list[dict]:
    out = []

    def add(kind: str, prompt: str, guide_type: str, guide: str) -> None:
        out.append({"id": f"{kind}-{sum(1 for t in out if t['kind'] == kind):02d}", "kind": kind, "prompt": prompt,
                    "guide_type": guide_type, "guide": guide, "max_tokens": MAX_TOKENS})

    for schema, text in EXTRACTION:
        fields = ", ".join(schema["properties"])
        add("extraction", f"Extract {fields} from the text as JSON.\nText: {text}", "json_schema", json.dumps(schema))
    for tool, text in TOOL_CALLS:
        add("tool_call", f"You can call the tool {tool}. Reply with the tool call as JSON.\nUser: {text}", "json_schema",
            json.dumps(TOOLS[tool]))
    for schema, text in CLASSIFICATION:
        add("classification", f"Classify the text. Reply as JSON.\n{text}", "json_schema", json.dumps(schema))
    for regex, text in FORMATS:
        add("format", text, "regex", regex)
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("tasks.jsonl")
    rows = tasks()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} tasks -> {path}")
