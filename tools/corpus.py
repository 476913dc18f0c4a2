"""Deterministic, seeded, template-built training corpus for the specparity fixture models.

No downloads: every document is generated from the templates and small knowledge tables below.
The categories are the product's prompt categories (``prompts/default.jsonl`` uses the same nine),
so the prompt suite is in-distribution:

    commonsense, math, zh_writing, list, logic, summary, zh_qa, code, repeat

A document is either a chat (system?/user/assistant turns, rendered with the Qwen-style template
that ``tools/build_fixtures.py`` writes into ``tokenizer_config.json``; every assistant turn ends
with ``<|im_end|>`` so the model learns to stop) or plain text (ends with ``<|endoftext|>``).

Determinism: document ``i`` of stream ``seed`` is drawn from ``random.Random(f"{seed}:{i}")``
(string seeds hash with SHA-512 inside ``random``: stable across runs, processes and platforms),
so generation is order-independent and reproducible.

Usage::

    python tools/corpus.py --n 20 --seed 0            # print 20 rendered documents
    python tools/corpus.py --n 100000 --out corpus.txt  # one JSON string per line
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Callable, Iterable

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, MASK, PAD]

CATEGORIES = ["commonsense", "math", "zh_writing", "list", "logic", "summary", "zh_qa", "code", "repeat"]

# Chat template (Jinja, Qwen style without tools/thinking). ``render_chat`` below must produce
# exactly what this template produces, so training text and engine-side prompts agree.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SYSTEM_EN = ["You are a helpful assistant.", "You are a concise assistant. Answer briefly."]
SYSTEM_ZH = ["你是一个有用的助手。", "你是一个简洁的助手，请简短回答。"]


def render_chat(messages: list[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    out = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)
    if add_generation_prompt:
        out += f"{IM_START}assistant\n"
    return out


# ---------------------------------------------------------------------------------------------
# Knowledge tables
# ---------------------------------------------------------------------------------------------

NAMES_EN = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Lily", "Max", "Sara",
            "Paul", "Nina", "Oscar", "Ruth", "Adam", "Grace", "Hugo", "Iris"]
PRONOUN = {n: ("he" if n in {"Tom", "Ben", "Sam", "Jack", "Leo", "Max", "Paul", "Oscar", "Adam", "Hugo"} else "she")
           for n in NAMES_EN}
NAMES_ZH = ["小明", "小红", "小刚", "小丽", "小华", "小芳", "小强", "小雪", "小军", "小梅", "小东", "小燕"]

# animal: (sound_en, home_en, food_en, zh_name, sound_zh, home_zh, food_zh)
ANIMALS = {
    "dog": ("barks", "in a house with people", "meat and dog food", "狗", "汪汪叫", "人的家里", "肉和狗粮"),
    "cat": ("meows", "in a house with people", "fish and cat food", "猫", "喵喵叫", "人的家里", "鱼和猫粮"),
    "cow": ("moos", "on a farm", "grass", "牛", "哞哞叫", "农场里", "草"),
    "duck": ("quacks", "near a pond", "seeds and small fish", "鸭子", "嘎嘎叫", "池塘边", "种子和小鱼"),
    "sheep": ("baas", "on a farm", "grass", "羊", "咩咩叫", "农场里", "草"),
    "horse": ("neighs", "on a farm", "hay and oats", "马", "嘶嘶叫", "农场里", "干草和燕麦"),
    "frog": ("croaks", "near a pond", "insects", "青蛙", "呱呱叫", "池塘边", "昆虫"),
    "bee": ("buzzes", "in a hive", "nectar from flowers", "蜜蜂", "嗡嗡叫", "蜂巢里", "花蜜"),
    "lion": ("roars", "on the grassland", "meat", "狮子", "吼叫", "草原上", "肉"),
    "owl": ("hoots", "in a tree", "mice and insects", "猫头鹰", "咕咕叫", "树上", "老鼠和昆虫"),
    "pig": ("oinks", "on a farm", "corn and vegetables", "猪", "哼哼叫", "农场里", "玉米和蔬菜"),
    "bird": ("sings", "in a nest in a tree", "seeds and worms", "小鸟", "叽叽喳喳地叫", "树上的鸟窝里", "种子和虫子"),
}
# object: (use_en (gerund phrase), verb phrase, zh_name, use_zh)
OBJECTS = {
    "umbrella": ("keeping you dry in the rain", "stay dry in the rain", "雨伞", "在下雨时保持身体干燥"),
    "knife": ("cutting food", "cut food", "刀", "切食物"),
    "pen": ("writing on paper", "write on paper", "笔", "在纸上写字"),
    "cup": ("holding drinks", "hold a drink", "杯子", "装饮料"),
    "bed": ("sleeping", "sleep", "床", "睡觉"),
    "key": ("opening locks", "open a lock", "钥匙", "开锁"),
    "clock": ("telling the time", "tell the time", "钟", "看时间"),
    "refrigerator": ("keeping food cold", "keep food cold", "冰箱", "让食物保持低温"),
    "broom": ("sweeping the floor", "sweep the floor", "扫帚", "扫地"),
    "ladder": ("reaching high places", "reach high places", "梯子", "够到高处"),
    "map": ("finding the way", "find the way", "地图", "找路"),
    "soap": ("washing your hands", "wash your hands", "肥皂", "洗手"),
    "towel": ("drying your body", "dry your body", "毛巾", "擦干身体"),
    "hammer": ("driving nails into wood", "drive a nail into wood", "锤子", "把钉子敲进木头"),
    "scissors": ("cutting paper", "cut paper", "剪刀", "剪纸"),
    "spoon": ("eating soup", "eat soup", "勺子", "喝汤"),
}
# thing: (color_en, zh_name, color_zh)
COLORS_OF = {
    "the sky on a clear day": ("blue", "晴天的天空", "蓝色"),
    "grass": ("green", "草", "绿色"),
    "snow": ("white", "雪", "白色"),
    "a ripe banana": ("yellow", "成熟的香蕉", "黄色"),
    "a ripe tomato": ("red", "成熟的西红柿", "红色"),
    "coal": ("black", "煤", "黑色"),
    "an orange": ("orange", "橙子", "橙色"),
    "milk": ("white", "牛奶", "白色"),
    "the sea": ("blue", "大海", "蓝色"),
    "a lemon": ("yellow", "柠檬", "黄色"),
}
# cause -> effect (en), (zh cause, zh effect)
CAUSES = [
    ("drop a glass on a hard floor", "it usually breaks", "把玻璃杯摔在硬地板上", "它通常会碎"),
    ("leave ice in the sun", "it melts into water", "把冰放在太阳下", "它会融化成水"),
    ("heat water to 100 degrees Celsius", "it boils", "把水加热到100摄氏度", "水会沸腾"),
    ("put water in the freezer", "it turns into ice", "把水放进冰箱的冷冻室", "水会结成冰"),
    ("forget to water a plant", "the plant dries out", "忘记给植物浇水", "植物会枯萎"),
    ("stay up very late", "you feel tired the next day", "熬夜到很晚", "第二天会觉得很累"),
    ("mix red and yellow paint", "you get orange paint", "把红色和黄色的颜料混在一起", "会得到橙色的颜料"),
    ("touch a hot stove", "you can burn your hand", "碰到很烫的炉子", "手会被烫伤"),
    ("run for a long time", "your heart beats faster", "跑步跑了很长时间", "心跳会变快"),
    ("leave bread out for many days", "it gets hard and can grow mold", "把面包放在外面很多天", "面包会变硬，还可能发霉"),
]

LIST_CATEGORIES = {
    # name_en: (items_en, name_zh, items_zh)
    "fruits": (["Apple", "Banana", "Orange", "Grape", "Mango", "Pear", "Peach", "Cherry", "Lemon", "Watermelon"],
               "水果", ["苹果", "香蕉", "橙子", "葡萄", "芒果", "梨", "桃子", "樱桃", "柠檬", "西瓜"]),
    "colors": (["Red", "Orange", "Yellow", "Green", "Blue", "Purple", "Pink", "Brown", "Black", "White"],
               "颜色", ["红色", "橙色", "黄色", "绿色", "蓝色", "紫色", "粉色", "棕色", "黑色", "白色"]),
    "animals": (["Dog", "Cat", "Horse", "Cow", "Sheep", "Lion", "Tiger", "Elephant", "Monkey", "Rabbit"],
                "动物", ["狗", "猫", "马", "牛", "羊", "狮子", "老虎", "大象", "猴子", "兔子"]),
    "planets": (["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
                "行星", ["水星", "金星", "地球", "火星", "木星", "土星", "天王星", "海王星"]),
    "days of the week": (["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
                         "星期", ["星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日"]),
    "months": (["January", "February", "March", "April", "May", "June", "July", "August", "September",
                "October", "November", "December"],
               "月份", ["一月", "二月", "三月", "四月", "五月", "六月", "七月", "八月", "九月", "十月", "十一月", "十二月"]),
    "vegetables": (["Carrot", "Potato", "Tomato", "Cabbage", "Onion", "Spinach", "Broccoli", "Pepper", "Cucumber",
                    "Pumpkin"],
                   "蔬菜", ["胡萝卜", "土豆", "西红柿", "白菜", "洋葱", "菠菜", "西兰花", "辣椒", "黄瓜", "南瓜"]),
    "sports": (["Football", "Basketball", "Tennis", "Swimming", "Running", "Badminton", "Volleyball", "Table tennis",
                "Cycling", "Skiing"],
               "运动", ["足球", "篮球", "网球", "游泳", "跑步", "羽毛球", "排球", "乒乓球", "骑自行车", "滑雪"]),
    "programming languages": (["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "Swift", "Kotlin"],
                              "编程语言", ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "Swift",
                                       "Kotlin"]),
    "musical instruments": (["Piano", "Guitar", "Violin", "Drums", "Flute", "Trumpet", "Cello", "Harp", "Saxophone",
                             "Clarinet"],
                            "乐器", ["钢琴", "吉他", "小提琴", "鼓", "笛子", "小号", "大提琴", "竖琴", "萨克斯", "单簧管"]),
}
HOWTO = {
    # task_en: (steps_en, task_zh, steps_zh)
    "make a cup of tea": (["Boil some water.", "Put a tea bag in a cup.", "Pour the hot water into the cup.",
                           "Wait for three minutes.", "Take out the tea bag and enjoy your tea."],
                          "泡一杯茶", ["把水烧开。", "把茶叶放进杯子里。", "把热水倒进杯子。", "等三分钟。", "慢慢品尝。"]),
    "wash your hands": (["Wet your hands with water.", "Put soap on your hands.", "Rub your hands for twenty seconds.",
                         "Rinse your hands with water.", "Dry your hands with a clean towel."],
                        "洗手", ["用水打湿双手。", "在手上抹肥皂。", "搓手二十秒。", "用清水冲洗干净。", "用干净的毛巾擦干。"]),
    "plant a tree": (["Choose a sunny place.", "Dig a deep hole.", "Put the young tree in the hole.",
                      "Fill the hole with soil.", "Water the tree well."],
                     "种一棵树", ["选一个阳光充足的地方。", "挖一个深坑。", "把小树放进坑里。", "用土把坑填满。", "给树浇足水。"]),
    "brush your teeth": (["Put toothpaste on your toothbrush.", "Brush the front of your teeth.",
                          "Brush the back of your teeth.", "Brush your tongue.", "Rinse your mouth with water."],
                         "刷牙", ["在牙刷上挤牙膏。", "刷牙齿的正面。", "刷牙齿的背面。", "轻轻刷一下舌头。", "用清水漱口。"]),
    "cook rice": (["Wash the rice in cold water.", "Put the rice and water in a pot.", "Bring the water to a boil.",
                   "Turn the heat down and cover the pot.", "Cook for fifteen minutes."],
                  "煮米饭", ["用冷水把米洗干净。", "把米和水放进锅里。", "把水烧开。", "调小火并盖上锅盖。", "再煮十五分钟。"]),
}

NONSENSE = ["blickets", "wugs", "daxes", "feps", "zorbs", "glims", "tovs", "moxes", "plens", "drubs"]
REAL_CHAINS = [("cats", "mammals", "animals"), ("roses", "flowers", "plants"), ("sparrows", "birds", "animals"),
               ("apples", "fruits", "foods"), ("oaks", "trees", "plants"), ("squares", "rectangles", "shapes"),
               ("trout", "fish", "animals"), ("violins", "string instruments", "instruments")]
ZH_CHAINS = [("猫", "哺乳动物", "动物"), ("玫瑰", "花", "植物"), ("麻雀", "鸟", "动物"), ("苹果", "水果", "食物"),
             ("橡树", "树", "植物"), ("正方形", "长方形", "图形")]
ZH_NONSENSE = ["布里克", "乌格", "达克斯", "费普", "佐布", "格林"]
COMPARE_EN = [("taller", "tallest", "shortest"), ("older", "oldest", "youngest"), ("faster", "fastest", "slowest"),
              ("heavier", "heaviest", "lightest")]
COMPARE_ZH = [("高", "最高", "最矮"), ("大", "年龄最大", "年龄最小"), ("快", "跑得最快", "跑得最慢"), ("重", "最重", "最轻")]
CONDITIONALS = [("it rains", "the ground gets wet", "It is raining", "the ground is wet"),
                ("the sun sets", "it gets dark", "The sun has set", "it is dark"),
                ("you heat ice", "it melts", "You heat some ice", "the ice melts"),
                ("a plant gets no water", "it dies", "This plant gets no water", "the plant dies"),
                ("the alarm rings", "Tom wakes up", "The alarm is ringing", "Tom wakes up")]

JOBS = [("teacher", "老师"), ("doctor", "医生"), ("baker", "面包师"), ("farmer", "农民"), ("nurse", "护士"),
        ("painter", "画家"), ("driver", "司机"), ("cook", "厨师"), ("pilot", "飞行员"), ("writer", "作家")]
CITIES = [("Paris", "巴黎"), ("London", "伦敦"), ("Tokyo", "东京"), ("Berlin", "柏林"), ("Rome", "罗马"),
          ("Madrid", "马德里"), ("Sydney", "悉尼"), ("Toronto", "多伦多"), ("Cairo", "开罗"), ("Seoul", "首尔")]
DAILY = [("walks to work", "步行去上班"), ("reads the newspaper", "看报纸"), ("drinks a cup of coffee", "喝一杯咖啡"),
         ("feeds the birds in the park", "在公园里喂鸟"), ("rides a bike to work", "骑自行车去上班")]
# event: (long_en, short_en, long_zh, short_zh)
EVENTS = [
    ("found a small lost dog near the river", "found a lost dog", "在河边发现了一只走丢的小狗", "发现了一只走丢的小狗"),
    ("won first prize in a local cooking contest", "won a cooking contest", "在当地的烹饪比赛中获得了一等奖",
     "获得了烹饪比赛一等奖"),
    ("helped an old man carry his heavy bags home", "helped an old man", "帮助一位老人把很重的袋子搬回家",
     "帮助了一位老人"),
    ("lost the keys to the house on the way home", "lost the house keys", "在回家的路上弄丢了家里的钥匙",
     "弄丢了钥匙"),
    ("started to learn how to play the piano", "started learning the piano", "开始学习弹钢琴", "开始学钢琴"),
    ("planted ten trees in the school garden", "planted ten trees", "在学校的花园里种了十棵树", "种了十棵树"),
]
# outcome: (long_en, short_en, long_zh, short_zh)
OUTCOMES = [
    ("Everyone in the town was happy", "made the town happy", "镇上的每个人都很高兴", "让大家都很高兴"),
    ("It became the best day of the year", "had a great day", "那成了一年中最好的一天", "度过了美好的一天"),
    ("Since then, life has been a little better", "felt better afterwards", "从那以后，生活变得更好了",
     "之后过得更好了"),
    ("The story was even in the local newspaper", "appeared in the newspaper", "这件事还上了当地的报纸",
     "上了报纸"),
]
FACILITIES = [("library", "图书馆"), ("park", "公园"), ("hospital", "医院"), ("bridge", "大桥"), ("museum", "博物馆"),
              ("school", "学校")]
GROUPS = [("students", "学生"), ("families", "家庭"), ("older people", "老年人"), ("workers", "工人"),
          ("children", "孩子们")]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEEKDAYS_ZH = ["星期一", "星期二", "星期三", "星期四", "星期五", "星期六", "星期日"]

# zh_qa facts: (question variants, answer)
ZH_CAPITALS = [("中国", "北京"), ("日本", "东京"), ("法国", "巴黎"), ("英国", "伦敦"), ("德国", "柏林"), ("美国", "华盛顿"),
               ("俄罗斯", "莫斯科"), ("意大利", "罗马"), ("韩国", "首尔"), ("埃及", "开罗"), ("加拿大", "渥太华"),
               ("澳大利亚", "堪培拉"), ("印度", "新德里"), ("西班牙", "马德里"), ("巴西", "巴西利亚")]
ZH_POEMS = [("静夜思", "唐代", "李白"), ("春晓", "唐代", "孟浩然"), ("登鹳雀楼", "唐代", "王之涣"), ("望庐山瀑布", "唐代", "李白"),
            ("悯农", "唐代", "李绅"), ("咏鹅", "唐代", "骆宾王"), ("江雪", "唐代", "柳宗元"), ("清明", "唐代", "杜牧"),
            ("水调歌头", "宋代", "苏轼"), ("游子吟", "唐代", "孟郊")]
ZH_FESTIVALS = [("春节", "农历正月初一", "贴春联、放鞭炮、吃饺子"), ("元宵节", "农历正月十五", "吃元宵、看花灯"),
                ("端午节", "农历五月初五", "吃粽子、赛龙舟"), ("中秋节", "农历八月十五", "吃月饼、赏月"),
                ("重阳节", "农历九月初九", "登高、赏菊"), ("七夕节", "农历七月初七", "看星星、讲牛郎织女的故事")]
ZH_FACTS = [
    ("中国最长的河流是什么？", "中国最长的河流是长江，全长约6300公里。"),
    ("世界上最高的山峰是哪一座？", "世界上最高的山峰是珠穆朗玛峰，海拔约8849米。"),
    ("太阳系中最大的行星是哪一颗？", "太阳系中最大的行星是木星。"),
    ("离太阳最近的行星是哪一颗？", "离太阳最近的行星是水星。"),
    ("水的沸点是多少？", "在标准大气压下，水的沸点是100摄氏度。"),
    ("一年有多少天？", "平年有365天，闰年有366天。"),
    ("一天有多少个小时？", "一天有24个小时。"),
    ("人体最大的器官是什么？", "人体最大的器官是皮肤。"),
    ("长城位于哪个国家？", "长城位于中国，是世界上最著名的古代建筑之一。"),
    ("世界上面积最大的海洋是哪一个？", "世界上面积最大的海洋是太平洋。"),
    ("彩虹有几种颜色？", "彩虹通常有七种颜色：红、橙、黄、绿、蓝、靛、紫。"),
    ("植物通过什么作用制造养分？", "植物通过光合作用制造养分，它们利用阳光、水和二氧化碳产生氧气和葡萄糖。"),
    ("地球绕太阳转一圈需要多长时间？", "地球绕太阳转一圈大约需要365天，也就是一年。"),
    ("中国有多少个省级行政区？", "中国有34个省级行政区。"),
    ("熊猫主要吃什么？", "大熊猫主要吃竹子。"),
    ("月亮本身会发光吗？", "月亮本身不会发光，我们看到的月光是它反射的太阳光。"),
]
ZH_CITY_INFO = [("北京", "中国的首都", "故宫和长城", "烤鸭"), ("上海", "中国最大的城市之一", "外滩和东方明珠", "小笼包"),
                ("西安", "一座历史悠久的古城", "兵马俑和古城墙", "肉夹馍"), ("成都", "四川省的省会", "大熊猫基地和宽窄巷子", "火锅"),
                ("杭州", "浙江省的省会", "西湖", "龙井茶"), ("广州", "广东省的省会", "广州塔", "早茶")]

# zh_writing pools: topic -> (scene words, lines)
ZH_TOPICS = {
    "春天": (["春风", "桃花", "细雨", "燕子", "柳枝", "小草"], ["春风吹绿了江岸", "桃花开满了山坡", "细雨轻轻落下", "燕子飞回了屋檐", "柳枝在风中摇摆", "小草从地里探出头"]),
    "秋天": (["落叶", "明月", "稻谷", "大雁", "枫叶", "秋风"], ["落叶铺满了小路", "明月挂在天上", "稻谷一片金黄", "大雁向南飞去", "枫叶红得像火", "秋风带来了凉意"]),
    "大海": (["海浪", "沙滩", "海鸥", "贝壳", "渔船", "蓝天"], ["海浪拍打着礁石", "沙滩上留下脚印", "海鸥在天空飞翔", "贝壳躺在沙子里", "渔船慢慢回到港口", "蓝天映在海面上"]),
    "故乡": (["小河", "老屋", "炊烟", "田野", "月光", "小路"], ["小河静静地流淌", "老屋站在村口", "炊烟慢慢升起", "田野一望无际", "月光洒在窗前", "小路通向远方"]),
    "冬天": (["白雪", "寒风", "梅花", "炉火", "冰花", "雪人"], ["白雪覆盖了大地", "寒风吹过树林", "梅花在雪中开放", "炉火温暖了小屋", "冰花贴在窗上", "孩子们堆起雪人"]),
    "夜晚": (["星星", "月亮", "灯火", "微风", "虫鸣", "夜空"], ["星星眨着眼睛", "月亮照亮了小路", "灯火点亮了城市", "微风吹过脸庞", "虫鸣声此起彼伏", "夜空安静而深远"]),
}
ZH_FEELINGS = ["让人心情愉快", "让人感到温暖", "让人想起童年", "让人感到安静", "让人流连忘返"]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _chat(user: str, assistant: str, rng: random.Random, lang: str, system_p: float = 0.15) -> dict:
    msgs: list[tuple[str, str]] = []
    if rng.random() < system_p:
        msgs.append(("system", rng.choice(SYSTEM_ZH if lang == "zh" else SYSTEM_EN)))
    msgs.append(("user", user))
    msgs.append(("assistant", assistant))
    return {"kind": "chat", "messages": msgs}


def _text(text: str) -> dict:
    return {"kind": "text", "text": text}


# ---------------------------------------------------------------------------------------------
# commonsense
# ---------------------------------------------------------------------------------------------


def gen_commonsense(rng: random.Random) -> dict:
    zh = rng.random() < 0.35
    kind = rng.randrange(7)
    if kind == 0:
        a = rng.choice(list(ANIMALS))
        s, home, food, zn, szh, hzh, fzh = ANIMALS[a]
        if zh:
            q = rng.choice([f"{zn}是怎么叫的？", f"{zn}怎么叫？", f"{zn}发出什么声音？"])
            return _chat(q, f"{zn}会{szh}。", rng, "zh")
        q = rng.choice([f"What sound does {_article(a)} {a} make?", f"What noise does {_article(a)} {a} make?",
                        f"How does {_article(a)} {a} sound?"])
        return _chat(q, f"{_cap(_article(a))} {a} {s}.", rng, "en")
    if kind == 1:
        a = rng.choice(list(ANIMALS))
        s, home, food, zn, szh, hzh, fzh = ANIMALS[a]
        if zh:
            q = rng.choice([f"{zn}住在哪里？", f"{zn}一般生活在哪里？"])
            return _chat(q, f"{zn}通常住在{hzh}。", rng, "zh")
        q = rng.choice([f"Where does {_article(a)} {a} live?", f"Where can you find {_article(a)} {a}?"])
        return _chat(q, f"{_cap(_article(a))} {a} usually lives {home}.", rng, "en")
    if kind == 2:
        a = rng.choice(list(ANIMALS))
        s, home, food, zn, szh, hzh, fzh = ANIMALS[a]
        if zh:
            ans = f"关于{zn}的三个事实：\n1. {zn}会{szh}。\n2. {zn}通常住在{hzh}。\n3. {zn}喜欢吃{fzh}。"
            return _chat(rng.choice([f"告诉我关于{zn}的三个事实。", f"说出关于{zn}的三个事实。"]), ans, rng, "zh")
        art = _article(a)
        ans = (f"Here are three facts about the {a}:\n1. {_cap(art)} {a} {s}.\n2. {_cap(art)} {a} usually lives {home}.\n"
               f"3. {_cap(art)} {a} eats {food}.")
        if rng.random() < 0.4:
            return _text(f"Three facts about the {a}.\n{ans.split(':', 1)[1].strip()}\n{EOT}")
        q = rng.choice([f"Tell me three facts about the {a}.", f"Give me three facts about the {a}.",
                        f"What are three facts about the {a}?"])
        return _chat(q, ans, rng, "en")
    if kind == 3:
        o = rng.choice(list(OBJECTS))
        use, verb, zn, uzh = OBJECTS[o]
        if zh:
            return _chat(rng.choice([f"{zn}是用来做什么的？", f"{zn}有什么用？"]), f"{zn}是用来{uzh}的。", rng, "zh")
        if rng.random() < 0.5:
            return _chat(f"What is {_article(o)} {o} used for?", f"{_cap(_article(o))} {o} is used for {use}.", rng, "en")
        return _chat(f"What do you use to {verb}?", f"You use {_article(o)} {o} to {verb}.", rng, "en")
    if kind == 4:
        t = rng.choice(list(COLORS_OF))
        c, zn, czh = COLORS_OF[t]
        if zh:
            return _chat(rng.choice([f"{zn}是什么颜色的？", f"{zn}是什么颜色？"]), f"{zn}是{czh}的。", rng, "zh")
        return _chat(rng.choice([f"What color is {t}?", f"What is the color of {t}?"]), f"{_cap(t)} is {c}.", rng, "en")
    if kind == 5:
        cause, eff, czh, ezh = rng.choice(CAUSES)
        if zh:
            q = rng.choice([f"如果{czh}，会发生什么？", f"{czh}会怎么样？", f"要是{czh}，会怎样？"])
            return _chat(q, f"如果{czh}，{ezh}。", rng, "zh")
        if rng.random() < 0.3:
            return _text(f"Q: What happens if you {cause}?\nA: If you {cause}, {eff}.\n{EOT}")
        q = rng.choice([f"What happens if you {cause}?", f"What will happen if you {cause}?"])
        return _chat(q, f"If you {cause}, {eff}.", rng, "en")
    # kind 6: a longer explanation
    o = rng.choice(list(OBJECTS))
    use, verb, zn, uzh = OBJECTS[o]
    if zh:
        ans = f"{zn}是日常生活中常见的东西。它是用来{uzh}的。如果没有{zn}，我们就很难{uzh}。所以很多家庭都有{zn}。"
        return _chat(rng.choice([f"为什么家里需要{zn}？", f"家里为什么要有{zn}？"]), ans, rng, "zh")
    ans = (f"{_cap(_article(o))} {o} is a common thing in daily life. It is used for {use}. Without {_article(o)} {o}, "
           f"it would be hard to {verb}. That is why many homes have {_article(o)} {o}.")
    q = rng.choice([f"Why do people keep {_article(o)} {o} at home?", f"Why is {_article(o)} {o} useful at home?"])
    return _chat(q, ans, rng, "en")


# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------

ITEMS_EN = [("apple", "apples"), ("book", "books"), ("pencil", "pencils"), ("ball", "balls"), ("card", "cards"),
            ("cookie", "cookies"), ("flower", "flowers"), ("marble", "marbles")]
ITEMS_ZH = [("苹果", "个"), ("书", "本"), ("铅笔", "支"), ("球", "个"), ("卡片", "张"), ("饼干", "块"), ("花", "朵")]


def gen_math(rng: random.Random) -> dict:
    zh = rng.random() < 0.35
    kind = rng.randrange(6)
    if kind == 0:  # plain arithmetic
        op = rng.choice("+-*")
        if op == "+":
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            c = a + b
        elif op == "-":
            a = rng.randint(2, 99)
            b = rng.randint(1, a)
            c = a - b
        else:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            c = a * b
        if zh:
            w = {"+": "加", "-": "减", "*": "乘以"}[op]
            return _chat(f"{a}{w}{b}等于多少？", f"{a} {op} {b} = {c}。", rng, "zh")
        form = rng.randrange(3)
        if form == 0:
            return _chat(f"What is {a} {op} {b}?", f"{a} {op} {b} = {c}.", rng, "en")
        if form == 1:
            return _chat(f"Calculate {a} {op} {b}.", f"{a} {op} {b} = {c}. The answer is {c}.", rng, "en")
        lines = []
        for _ in range(rng.randint(3, 6)):
            x, y = rng.randint(1, 50), rng.randint(1, 50)
            lines.append(f"{x} + {y} = {x + y}")
        return _text("\n".join(lines) + f"\n{EOT}")
    if kind in (1, 2):  # word problem
        if zh:
            n = rng.choice(NAMES_ZH)
            item, unit = rng.choice(ITEMS_ZH)
            a, b = rng.randint(2, 30), rng.randint(1, 20)
            if kind == 1:
                q = f"{n}有{a}{unit}{item}，又买了{b}{unit}。{n}现在一共有多少{unit}{item}？"
                ans = f"{n}原来有{a}{unit}{item}，又买了{b}{unit}，所以一共有{a} + {b} = {a + b}{unit}{item}。答案是{a + b}。"
            else:
                a = a + b
                q = f"{n}有{a}{unit}{item}，送给朋友{b}{unit}。{n}还剩多少{unit}{item}？"
                ans = f"{n}原来有{a}{unit}{item}，送出了{b}{unit}，所以还剩{a} - {b} = {a - b}{unit}{item}。答案是{a - b}。"
            return _chat(q, ans, rng, "zh")
        n = rng.choice(NAMES_EN)
        p = PRONOUN[n]
        s, pl = rng.choice(ITEMS_EN)
        a, b = rng.randint(2, 30), rng.randint(1, 20)
        if kind == 1:
            q = f"{n} has {a} {pl}. {_cap(p)} buys {b} more. How many {pl} does {n} have now?"
            ans = f"{n} starts with {a} {pl}. After buying {b} more, {n} has {a} + {b} = {a + b} {pl}. The answer is {a + b}."
        else:
            a = a + b
            q = f"{n} has {a} {pl}. {_cap(p)} gives {b} to a friend. How many {pl} does {n} have left?"
            ans = f"{n} starts with {a} {pl}. After giving away {b}, {n} has {a} - {b} = {a - b} {pl} left. The answer is {a - b}."
        return _chat(q, ans, rng, "en")
    if kind == 3:  # step by step a + b * c
        a, b, c = rng.randint(1, 50), rng.randint(2, 9), rng.randint(2, 9)
        bc = b * c
        if zh:
            q = f"请一步一步计算：{a} + {b} * {c}"
            ans = f"第一步：先算乘法，{b} * {c} = {bc}。\n第二步：再算加法，{a} + {bc} = {a + bc}。\n所以答案是{a + bc}。"
            return _chat(q, ans, rng, "zh")
        q = f"Solve step by step: {a} + {b} * {c}"
        ans = (f"Step 1: First multiply: {b} * {c} = {bc}.\nStep 2: Then add: {a} + {bc} = {a + bc}.\n"
               f"The answer is {a + bc}.")
        return _chat(q, ans, rng, "en")
    if kind == 4:  # multi-step word problem: price * count + change
        price, count = rng.randint(2, 9), rng.randint(2, 9)
        paid = price * count + rng.randint(1, 20)
        total = price * count
        if zh:
            n = rng.choice(NAMES_ZH)
            q = f"{n}买了{count}支笔，每支{price}元。{n}付了{paid}元，应该找回多少钱？请一步一步思考。"
            ans = (f"第一步：笔的总价是{count} * {price} = {total}元。\n第二步：找回的钱是{paid} - {total} = {paid - total}元。\n"
                   f"答案是{paid - total}元。")
            return _chat(q, ans, rng, "zh")
        n = rng.choice(NAMES_EN)
        q = (f"{n} buys {count} pens. Each pen costs {price} dollars. {n} pays with {paid} dollars. "
             f"How much change does {n} get? Think step by step.")
        ans = (f"Step 1: The pens cost {count} * {price} = {total} dollars.\nStep 2: The change is {paid} - {total} = "
               f"{paid - total} dollars.\nThe answer is {paid - total} dollars.")
        return _chat(q, ans, rng, "en")
    # kind 5: doubling / sequence reasoning
    start, k = rng.randint(1, 9), rng.randint(4, 7)
    seq = [start * 2 ** i for i in range(k)]
    if zh:
        q = f"从{start}开始，每次乘以2，写出前{k}个数。"
        ans = f"从{start}开始每次乘以2，前{k}个数是：" + "，".join(map(str, seq)) + "。"
        return _chat(q, ans, rng, "zh")
    q = f"Start at {start} and double it each time. Write the first {k} numbers."
    ans = f"Starting at {start} and doubling each time, the first {k} numbers are: " + ", ".join(map(str, seq)) + "."
    return _chat(q, ans, rng, "en")


# ---------------------------------------------------------------------------------------------
# zh_writing
# ---------------------------------------------------------------------------------------------


def gen_zh_writing(rng: random.Random) -> dict:
    topic = rng.choice(list(ZH_TOPICS))
    words, lines = ZH_TOPICS[topic]
    kind = rng.randrange(4)
    if kind == 0:  # four-line poem
        chosen = rng.sample(lines, 4)
        poem = f"《{topic}》\n" + "，\n".join(chosen[:2]) + "。\n" + "，\n".join(chosen[2:]) + "。"
        q = rng.choice([f"写一首关于{topic}的短诗。", f"请以{topic}为题写一首小诗。", f"以{topic}为主题写一首诗。",
                        f"写一首小诗，题目是{topic}。"])
        return _chat(q, poem, rng, "zh")
    if kind == 1:  # description
        w = rng.sample(words, 3)
        feel = rng.choice(ZH_FEELINGS)
        desc = (f"{topic}来了。{w[0]}、{w[1]}和{w[2]}构成了一幅美丽的画面。{rng.choice(lines)}，"
                f"{rng.choice(lines)}。这样的{topic}{feel}。")
        return _chat(rng.choice([f"描写一下{topic}的景色。", f"请描写{topic}的景色。", f"写一段话描写{topic}。"]), desc,
                     rng, "zh")
    if kind == 2:  # sentence with given words
        w = rng.sample(words, 2)
        ans = f"{rng.choice(lines)}，{w[0]}和{w[1]}都在诉说着{topic}的故事。"
        q = rng.choice([f"用“{w[0]}”和“{w[1]}”写一句关于{topic}的话。", f"请用“{w[0]}”和“{w[1]}”造一个关于{topic}的句子。"])
        return _chat(q, ans, rng, "zh")
    # plain text essay opening
    chosen = rng.sample(lines, 3)
    return _text(f"我眼中的{topic}\n\n" + "。".join(chosen) + f"。{topic}{rng.choice(ZH_FEELINGS)}。\n{EOT}")


# ---------------------------------------------------------------------------------------------
# list
# ---------------------------------------------------------------------------------------------


def gen_list(rng: random.Random) -> dict:
    zh = rng.random() < 0.35
    kind = rng.randrange(4)
    if kind <= 1:
        cat = rng.choice(list(LIST_CATEGORIES))
        items, czh, items_zh = LIST_CATEGORIES[cat]
        n = rng.randint(3, len(items))
        if zh:
            body = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(items_zh[:n]))
            if cat in ("days of the week", "months", "planets"):
                q = rng.choice([f"按顺序列出{n}个{czh}。", f"请按顺序列出{n}个{czh}。"])
            else:
                q = rng.choice([f"列出{n}种{czh}。", f"请列出{n}种{czh}。"])
            return _chat(q, f"以下是{n}个{czh}：\n{body}", rng, "zh")
        if kind == 0:
            body = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(items[:n]))
            q = rng.choice([f"List {n} {cat}.", f"Name {n} {cat}.", f"Give me a list of {n} {cat}."])
            return _chat(q, f"Here are {n} {cat}:\n{body}", rng, "en")
        body = "\n".join(f"- {x}" for x in items[:n])
        return _chat(f"Name {n} {cat} as a bulleted list.", f"Sure! Here are {n} {cat}:\n{body}", rng, "en")
    if kind == 2:
        task = rng.choice(list(HOWTO))
        steps, tzh, steps_zh = HOWTO[task]
        if zh:
            body = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(steps_zh))
            q = rng.choice([f"{tzh}的步骤是什么？", f"怎么{tzh}？", f"请说明{tzh}的步骤。"])
            return _chat(q, f"{tzh}的步骤如下：\n{body}", rng, "zh")
        body = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(steps))
        q = rng.choice([f"What are the steps to {task}?", f"How do I {task}?", f"Explain how to {task} step by step."])
        return _chat(q, f"To {task}, follow these steps:\n{body}", rng, "en")
    # plain: a titled list
    cat = rng.choice(list(LIST_CATEGORIES))
    items, czh, items_zh = LIST_CATEGORIES[cat]
    if zh:
        return _text(f"常见的{czh}：\n" + "\n".join(f"- {x}" for x in items_zh) + f"\n{EOT}")
    return _text(f"Common {cat}:\n" + "\n".join(f"- {x}" for x in items) + f"\n{EOT}")


# ---------------------------------------------------------------------------------------------
# logic
# ---------------------------------------------------------------------------------------------


def gen_logic(rng: random.Random) -> dict:
    zh = rng.random() < 0.35
    kind = rng.randrange(5)
    if kind in (0, 1):  # syllogism valid (0) / invalid (1)
        if zh:
            a, b, c = rng.choice(ZH_CHAINS) if rng.random() < 0.5 else tuple(rng.sample(ZH_NONSENSE, 3))
            ask = rng.choice([f"所有的{a}都是{c}吗？", f"能得出所有的{a}都是{c}吗？"])
            if kind == 0:
                q = f"所有的{a}都是{b}，所有的{b}都是{c}。{ask}"
                ans = f"是的。因为所有的{a}都是{b}，而所有的{b}都是{c}，所以所有的{a}都是{c}。"
            else:
                q = f"所有的{a}都是{b}，有些{b}是{c}。{ask}"
                ans = f"不一定。所有的{a}都是{b}，但只有一些{b}是{c}，所以不能得出所有的{a}都是{c}。"
            return _chat(q, ans, rng, "zh")
        a, b, c = rng.choice(REAL_CHAINS) if rng.random() < 0.5 else tuple(rng.sample(NONSENSE, 3))
        ask = rng.choice([f"Are all {a} {c}?", f"Can we conclude that all {a} are {c}?"])
        if kind == 0:
            q = f"All {a} are {b}. All {b} are {c}. {ask}"
            ans = f"Yes. All {a} are {b}, and all {b} are {c}. Therefore, all {a} are {c}."
        else:
            q = f"All {a} are {b}. Some {b} are {c}. {ask}"
            ans = (f"Not necessarily. All {a} are {b}, but only some {b} are {c}. "
                   f"So we cannot conclude that all {a} are {c}.")
        return _chat(q, ans, rng, "en")
    if kind == 2:  # three-way comparison
        if zh:
            x, y, z = rng.sample(NAMES_ZH, 3)
            adj, top, bottom = rng.choice(COMPARE_ZH)
            ask_top = rng.random() < 0.5
            q = f"{x}比{y}{adj}，{y}比{z}{adj}。谁{top if ask_top else bottom}？"
            ans = f"{x}比{y}{adj}，{y}比{z}{adj}，所以{x if ask_top else z}{top if ask_top else bottom}。"
            return _chat(q, ans, rng, "zh")
        x, y, z = rng.sample(NAMES_EN, 3)
        adj, top, bottom = rng.choice(COMPARE_EN)
        ask_top = rng.random() < 0.5
        q = f"{x} is {adj} than {y}. {y} is {adj} than {z}. Who is the {top if ask_top else bottom}?"
        ans = (f"{x} is {adj} than {y}, and {y} is {adj} than {z}. So {x if ask_top else z} is the "
               f"{top if ask_top else bottom}.")
        return _chat(q, ans, rng, "en")
    if kind == 3:  # modus ponens
        cond, res, fact, concl = rng.choice(CONDITIONALS)
        q = f"If {cond}, {res}. {fact}. What follows?"
        ans = f"Since {cond[0].lower() + cond[1:]} means {res}, and {fact[0].lower() + fact[1:]}, it follows that {concl}."
        return _chat(q, ans, rng, "en")
    # kind 4: ordering numbers
    nums = rng.sample(range(1, 100), rng.randint(4, 7))
    if zh:
        return _chat("把这些数从小到大排列：" + "，".join(map(str, nums)),
                     "从小到大排列是：" + "，".join(map(str, sorted(nums))) + "。", rng, "zh")
    return _chat("Sort these numbers from smallest to largest: " + ", ".join(map(str, nums)),
                 "From smallest to largest: " + ", ".join(map(str, sorted(nums))) + ".", rng, "en")


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------


def _story(rng: random.Random, zh: bool) -> tuple[str, str]:
    (job, jzh), (city, czh) = rng.choice(JOBS), rng.choice(CITIES)
    daily, dzh = rng.choice(DAILY)
    ev, evs, evzh, evszh = rng.choice(EVENTS)
    out, outs, outzh, outszh = rng.choice(OUTCOMES)
    if zh:
        n = rng.choice(NAMES_ZH)
        passage = f"{n}是{czh}的一名{jzh}。每天早上，{n}都会{dzh}。有一天，{n}{evzh}。{outzh}。"
        summary = f"{czh}的{jzh}{n}{evszh}，{outszh}。"
        return passage, summary
    n = rng.choice(NAMES_EN)
    p = PRONOUN[n]
    passage = (f"{n} is {_article(job)} {job} in {city}. Every morning, {p} {daily}. One day, {p} {ev}. {out}.")
    summary = f"{n}, {_article(job)} {job} in {city}, {evs} and {outs}."
    return passage, summary


def _news(rng: random.Random, zh: bool) -> tuple[str, str]:
    (fac, fzh), (city, czh), (grp, gzh) = rng.choice(FACILITIES), rng.choice(CITIES), rng.choice(GROUPS)
    cost, years = rng.randint(2, 90), rng.randint(2, 6)
    day = rng.randrange(7)
    mayor = rng.choice(NAMES_EN)
    if zh:
        passage = (f"{czh}在{WEEKDAYS_ZH[day]}开放了一座新的{fzh}。这座{fzh}花费了{cost}百万元，用了{years}年才建成。"
                   f"市长表示，它将为{gzh}提供很大的帮助。")
        summary = f"{czh}开放了一座花费{cost}百万元的新{fzh}，将帮助{gzh}。"
        return passage, summary
    passage = (f"The city of {city} opened a new {fac} on {WEEKDAYS[day]}. The {fac} cost {cost} million dollars and "
               f"took {years} years to build. Mayor {mayor} said it would help {grp}.")
    summary = f"{city} opened a new {fac} that cost {cost} million dollars and will help {grp}."
    return passage, summary


def gen_summary(rng: random.Random) -> dict:
    zh = rng.random() < 0.35
    passage, summary = (_story if rng.random() < 0.5 else _news)(rng, zh)
    if rng.random() < 0.45:  # plain: passage then "Summary:"
        return _text(f"{passage}\n\n{'总结' if zh else 'Summary'}: {summary}\n{EOT}")
    if zh:
        return _chat(f"用一句话总结下面这段话：\n\n{passage}", f"总结：{summary}", rng, "zh")
    q = rng.choice(["Summarize the following text in one sentence:", "Write a one-sentence summary of this text:"])
    return _chat(f"{q}\n\n{passage}", f"Summary: {summary}", rng, "en")


# ---------------------------------------------------------------------------------------------
# zh_qa
# ---------------------------------------------------------------------------------------------


def gen_zh_qa(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    pre = rng.choice(["", "", "请问，", "你知道"])
    if kind == 0:
        c, cap = rng.choice(ZH_CAPITALS)
        q = f"{pre}{c}的首都是哪里？" if pre != "你知道" else f"你知道{c}的首都是哪里吗？"
        return _chat(q, f"{c}的首都是{cap}。", rng, "zh")
    if kind == 1:
        p, dyn, author = rng.choice(ZH_POEMS)
        q = f"{pre}《{p}》的作者是谁？" if pre != "你知道" else f"你知道《{p}》的作者是谁吗？"
        return _chat(q, f"《{p}》的作者是{dyn}诗人{author}。", rng, "zh")
    if kind == 2:
        f, date, custom = rng.choice(ZH_FESTIVALS)
        q = rng.choice([f"{f}是哪一天？人们会做什么？", f"{f}是什么时候？人们会做什么？", f"请问，{f}是哪一天？人们会做什么？",
                        f"{f}在哪一天？有什么习俗？"])
        return _chat(q, f"{f}是{date}。在这一天，人们会{custom}。", rng, "zh")
    if kind == 3:
        city, what, sights, food = rng.choice(ZH_CITY_INFO)
        ans = f"{city}是{what}。这里有著名的{sights}，吸引了很多游客。{city}的{food}也非常有名。"
        return _chat(rng.choice([f"介绍一下{city}。", f"请介绍一下{city}。", f"给我介绍一下{city}这座城市。"]), ans, rng, "zh")
    q, a = rng.choice(ZH_FACTS)
    if pre == "请问，":
        q = pre + q
    if rng.random() < 0.25:
        return _text(f"问：{q}\n答：{a}\n{EOT}")
    return _chat(q, a, rng, "zh")


# ---------------------------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------------------------


def _run(code: str) -> str:
    """Execute a generated snippet (our own templates only) and capture what it prints."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "<corpus>", "exec"), {})  # noqa: S102 - templated, trusted code
    return buf.getvalue().rstrip("\n")


def _code_snippet(rng: random.Random) -> tuple[str, str, str]:
    """(description_en, description_zh, code)."""
    kind = rng.randrange(9)
    if kind == 0:
        n = rng.randint(3, 20)
        code = (f"def sum_to(n):\n    total = 0\n    for i in range(1, n + 1):\n        total += i\n    return total\n\n"
                f"print(sum_to({n}))")
        return f"adds the numbers from 1 to {n}", f"计算从1加到{n}的和", code
    if kind == 1:
        n = rng.randint(2, 8)
        code = (f"def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n\n"
                f"print(factorial({n}))")
        return f"computes the factorial of {n}", f"计算{n}的阶乘", code
    if kind == 2:
        n = rng.randint(5, 12)
        code = (f"def fibonacci(n):\n    a, b = 0, 1\n    result = []\n    for _ in range(n):\n        result.append(a)\n"
                f"        a, b = b, a + b\n    return result\n\nprint(fibonacci({n}))")
        return f"returns the first {n} Fibonacci numbers", f"返回前{n}个斐波那契数", code
    if kind == 3:
        n = rng.randint(3, 9)
        code = f"squares = [i * i for i in range({n})]\nprint(squares)"
        return f"makes a list of the squares of 0 to {n - 1}", f"生成0到{n - 1}的平方列表", code
    if kind == 4:
        w = rng.choice(["banana", "education", "python", "umbrella", "computer", "orange", "keyboard", "avocado"])
        code = (f"def count_vowels(word):\n    count = 0\n    for ch in word:\n        if ch in \"aeiou\":\n"
                f"            count += 1\n    return count\n\nprint(count_vowels(\"{w}\"))")
        return f"counts the vowels in \"{w}\"", f"统计\"{w}\"中元音字母的个数", code
    if kind == 5:
        w = rng.choice(["hello", "python", "stressed", "level", "world", "code", "spec", "draft"])
        code = f"def reverse(text):\n    return text[::-1]\n\nprint(reverse(\"{w}\"))"
        return f"reverses the string \"{w}\"", f"反转字符串\"{w}\"", code
    if kind == 6:
        nums = rng.sample(range(1, 60), rng.randint(4, 6))
        code = (f"def find_max(numbers):\n    best = numbers[0]\n    for x in numbers:\n        if x > best:\n"
                f"            best = x\n    return best\n\nprint(find_max({nums}))")
        return f"finds the largest number in {nums}", f"找出{nums}中最大的数", code
    if kind == 7:
        n, k = rng.randint(3, 6), rng.randint(2, 9)
        code = f"for i in range(1, {n + 1}):\n    print(i * {k})"
        return f"prints the first {n} multiples of {k}", f"打印{k}的前{n}个倍数", code
    n = rng.randint(2, 12)
    code = (f"def is_even(n):\n    return n % 2 == 0\n\nprint(is_even({n}))")
    return f"checks whether {n} is even", f"判断{n}是不是偶数", code


def gen_code(rng: random.Random) -> dict:
    zh = rng.random() < 0.3
    den, dzh, code = _code_snippet(rng)
    out = _run(code)
    out_en = f"This will output: {out}" if "\n" not in out else f"This will output:\n{out}"
    kind = rng.randrange(4)
    if kind == 0 or kind == 1:
        if zh:
            return _chat(f"用Python写一个函数，{dzh}。",
                         f"下面是{dzh}的代码：\n\n```python\n{code}\n```\n\n运行结果：{out}", rng, "zh")
        return _chat(f"Write a Python function that {den}.",
                     f"Here is a function that {den}:\n\n```python\n{code}\n```\n\n{out_en}", rng, "en")
    if kind == 2:
        if zh:
            return _chat(f"下面的代码会输出什么？\n\n```python\n{code}\n```", f"运行结果：{out}", rng, "zh")
        return _chat(f"What does this code print?\n\n```python\n{code}\n```", out_en, rng, "en")
    # plain: a source file with its output in a comment
    commented = "\n".join(f"# {line}" for line in out.split("\n"))
    return _text(f"# {den}\n{code}\n\n# Output:\n{commented}\n{EOT}")


# ---------------------------------------------------------------------------------------------
# repeat
# ---------------------------------------------------------------------------------------------

REPEAT_WORDS = ["hello", "yes", "go", "blue", "spec", "draft", "token", "apple", "ok", "test"]
REPEAT_LINES = ["The quick brown fox jumps over the lazy dog.", "All work and no play makes Jack a dull boy.",
                "Practice makes perfect.", "Speculative decoding must be lossless.", "Slow and steady wins the race.",
                "Every cloud has a silver lining."]
REPEAT_LINES_ZH = ["好好学习，天天向上。", "今天天气很好。", "失败是成功之母。", "一寸光阴一寸金。", "千里之行，始于足下。"]


def gen_repeat(rng: random.Random) -> dict:
    zh = rng.random() < 0.3
    kind = rng.randrange(7)
    if kind == 0:  # counting
        a = rng.randint(1, 40)
        b = a + rng.randint(5, 30)
        seq = list(range(a, b + 1))
        if zh:
            return _chat(f"从{a}数到{b}。", "、".join(map(str, seq)) + "。", rng, "zh")
        if rng.random() < 0.35:
            return _text(" ".join(map(str, seq)) + f"\n{EOT}")
        return _chat(f"Count from {a} to {b}.", ", ".join(map(str, seq)) + ".", rng, "en")
    if kind == 1:  # repeat a word
        w, n = rng.choice(REPEAT_WORDS), rng.randint(3, 20)
        return _chat(f"Repeat the word \"{w}\" {n} times.", " ".join([w] * n), rng, "en")
    if kind == 2:  # repeat a line
        n = rng.randint(2, 6)
        if zh:
            s = rng.choice(REPEAT_LINES_ZH)
            return _chat(f"把下面这句话重复{n}遍：{s}", "\n".join([s] * n), rng, "zh")
        s = rng.choice(REPEAT_LINES)
        return _chat(f"Repeat this sentence {n} times:\n{s}", "\n".join([s] * n), rng, "en")
    if kind == 3:  # copy a list
        cat = rng.choice(list(LIST_CATEGORIES))
        items, czh, items_zh = LIST_CATEGORIES[cat]
        pool = items_zh if zh else items
        chosen = rng.sample(pool, rng.randint(3, min(7, len(pool))))
        listed = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(chosen))
        if zh:
            return _chat(f"请原样抄写这个列表：\n{listed}", listed, rng, "zh")
        return _chat(f"Copy this list exactly:\n{listed}", listed, rng, "en")
    if kind == 4:  # multiplication table
        n, m = rng.randint(2, 12), rng.randint(5, 10)
        if zh:
            return _chat(f"写出{n}的乘法表，从1到{m}。", "\n".join(f"{n}×{i}={n * i}" for i in range(1, m + 1)), rng, "zh")
        return _chat(f"Write the multiplication table of {n} from 1 to {m}.",
                     "\n".join(f"{n} x {i} = {n * i}" for i in range(1, m + 1)), rng, "en")
    if kind == 5:  # markdown table of squares
        n = rng.randint(3, 8)
        rows = "\n".join(f"| {i} | {i * i} |" for i in range(1, n + 1))
        return _chat(f"Make a table of the numbers 1 to {n} and their squares.",
                     f"| n | n squared |\n|---|---|\n{rows}", rng, "en")
    # kind 6: plain repeated line text / alphabet
    if rng.random() < 0.5:
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        a = rng.randrange(0, 10)
        return _text(" ".join(letters[a:a + rng.randint(8, 16)]) + f"\n{EOT}")
    s = rng.choice(REPEAT_LINES)
    return _text("\n".join([s] * rng.randint(2, 5)) + f"\n{EOT}")


GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "commonsense": gen_commonsense,
    "math": gen_math,
    "zh_writing": gen_zh_writing,
    "list": gen_list,
    "logic": gen_logic,
    "summary": gen_summary,
    "zh_qa": gen_zh_qa,
    "code": gen_code,
    "repeat": gen_repeat,
}
# sampling weight per category (zh_writing is high-entropy by design; repeat/code are long)
WEIGHTS = {"commonsense": 1.0, "math": 1.3, "zh_writing": 0.8, "list": 1.0, "logic": 1.0, "summary": 1.0,
           "zh_qa": 1.0, "code": 1.3, "repeat": 1.2}


# ---------------------------------------------------------------------------------------------
# Rendering and streams
# ---------------------------------------------------------------------------------------------


def render(doc: dict) -> str:
    """Rendered training text of one document (chat docs end with ``<|im_end|>\\n<|endoftext|>``)."""
    if doc["kind"] == "text":
        return doc["text"]
    return render_chat(doc["messages"]) + EOT


def make_doc(seed: int | str, i: int, rng_two_turn: bool = True) -> dict:
    rng = random.Random(f"{seed}:{i}")
    cats = list(GENERATORS)
    cat = rng.choices(cats, weights=[WEIGHTS[c] for c in cats])[0]
    doc = GENERATORS[cat](rng)
    doc["category"] = cat
    # 8% of chats get a second user/assistant exchange from the same category
    if rng_two_turn and doc["kind"] == "chat" and rng.random() < 0.08:
        second = GENERATORS[cat](rng)
        if second["kind"] == "chat":
            doc["messages"] = doc["messages"] + [m for m in second["messages"] if m[0] != "system"]
    return doc


def user_texts(doc: dict) -> list[str]:
    if doc["kind"] != "chat":
        return []
    return [c for r, c in doc["messages"] if r == "user"]


def iter_docs(seed: int | str, n: int, exclude_user: set[str] | None = None,
              exclude_prefix: Iterable[str] = ()) -> Iterable[dict]:
    """``n`` documents of stream ``seed``; documents whose user turn equals a held-out prompt (or whose
    text starts with a held-out raw prompt) are skipped (they are not replaced: the stream stays
    index-stable)."""
    exclude_user = exclude_user or set()
    prefixes = tuple(exclude_prefix)
    for i in range(n):
        doc = make_doc(seed, i)
        if exclude_user and any(u in exclude_user for u in user_texts(doc)):
            continue
        if prefixes and doc["kind"] == "text" and doc["text"].startswith(prefixes):
            continue
        yield doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", default="0")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--out", help="write one JSON-encoded rendered document per line")
    args = ap.parse_args(argv)
    docs = iter_docs(args.seed, args.n)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(render(d), ensure_ascii=False) + "\n")
    else:
        for d in docs:
            sys.stdout.write(f"----- [{d['category']}]\n{render(d)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
